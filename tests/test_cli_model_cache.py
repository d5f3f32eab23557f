"""The GGUF conversion cache a first run fills: keyed on the file's content (size + SHA-256),
shared by every clone, one copy per model, a file hashed once. Conversion is replaced by a
stand-in that writes a minimal folder, so these tests take milliseconds."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from runtime.llm import loader


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    conversions, hashes = [], []

    def convert(gguf_path, out_dir):
        conversions.append(gguf_path)
        os.makedirs(out_dir)
        with open(gguf_path, "rb") as f:
            (tmp_path / "stamp").write_bytes(f.read())
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        shutil.copy(tmp_path / "stamp", os.path.join(out_dir, "model.safetensors"))
        return out_dir

    real_hash = loader._hash_file

    def counted_hash(path):
        hashes.append(path)
        return real_hash(path)

    monkeypatch.setattr(loader, "convert_gguf", convert)
    monkeypatch.setattr(loader, "_hash_file", counted_hash)
    root = tmp_path / "cache"
    return root, conversions, hashes


def _model(folder, content: bytes):
    os.makedirs(folder, exist_ok=True)
    path = folder / "tiny.gguf"
    path.write_bytes(content)
    return str(path)


def test_two_clones_share_one_conversion(cache, tmp_path):
    root, conversions, _ = cache
    a = _model(tmp_path / "clone_a", b"weights v1")
    b = _model(tmp_path / "clone_b", b"weights v1")
    dir_a, _ = loader.resolve_hf_dir(a, str(root))
    dir_b, _ = loader.resolve_hf_dir(b, str(root))
    assert dir_a == dir_b and conversions == [a]
    digest = hashlib.sha256(b"weights v1").hexdigest()[:16]
    assert os.path.basename(dir_a) == f"tiny-{len(b'weights v1')}-{digest}"


def test_an_unchanged_file_is_hashed_once(cache, tmp_path):
    root, conversions, hashes = cache
    a = _model(tmp_path / "clone_a", b"weights v1")
    for _ in range(3):
        loader.resolve_hf_dir(a, str(root))
    assert hashes == [os.path.abspath(a)] and len(conversions) == 1
    os.utime(a, ns=(1, 1))  # touched, same content: hashed again, not converted again
    loader.resolve_hf_dir(a, str(root))
    assert len(hashes) == 2 and len(conversions) == 1


def test_a_replaced_file_keeps_one_copy(cache, tmp_path):
    root, conversions, _ = cache
    a = _model(tmp_path / "clone_a", b"weights v1")
    old, _ = loader.resolve_hf_dir(a, str(root))
    _model(tmp_path / "clone_a", b"weights v2, longer")
    new, _ = loader.resolve_hf_dir(a, str(root))
    assert new != old and len(conversions) == 2
    assert not os.path.exists(old)  # the old version's conversion is gone
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["index.json", os.path.basename(new)]


def test_a_conversion_still_used_by_another_path_stays(cache, tmp_path):
    root, _, _ = cache
    a = _model(tmp_path / "clone_a", b"weights v1")
    b = _model(tmp_path / "clone_b", b"weights v1")
    shared, _ = loader.resolve_hf_dir(a, str(root))
    loader.resolve_hf_dir(b, str(root))
    _model(tmp_path / "clone_a", b"weights v2")
    loader.resolve_hf_dir(a, str(root))
    assert os.path.isdir(shared)  # clone_b still has that content


def test_a_conversion_under_the_old_key_is_adopted_without_converting(cache, tmp_path):
    root, conversions, _ = cache
    a = _model(tmp_path / "clone_a", b"weights v1")
    st = os.stat(a)
    key = f"{os.path.abspath(a)}|{st.st_size}|{st.st_mtime_ns}"
    legacy = root / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    os.makedirs(legacy)
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"converted long ago")
    out, _ = loader.resolve_hf_dir(a, str(root))
    assert conversions == [] and open(os.path.join(out, "model.safetensors"), "rb").read() == b"converted long ago"
    assert os.stat(os.path.join(out, "model.safetensors")).st_ino == (legacy / "model.safetensors").stat().st_ino
