"""`tandem generate` (streams one answer) and `tandem chat` (interactive).

Exit codes: 0 done, 2 bad arguments or a prompt the model cannot take, 130 interrupted.
Every error is one line on stderr that names the flag to change."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

from runtime.devices import device_problem
from runtime.llm.flags import engine_options, sampling_params


class UsageError(Exception):
    """A bad flag or prompt: printed as one line, exit code 2."""


def _flagged(message: str) -> str:
    """The engine's field names as the flags that set them, so an error says what to type."""
    for name in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_bytes",
        "max_tokens",
        "min_tokens",
        "top_p",
        "top_k",
        "temperature",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message.replace("model=", "--model ")


def load_llm(args):
    """(LLM, SamplingParams) from the parsed flags; UsageError for anything wrong, checked
    before the model loads where it can be."""
    problem = device_problem("--device", args.device)
    if problem:
        raise UsageError(problem)
    try:
        params = sampling_params(args)
    except ValueError as exc:
        raise UsageError(_flagged(str(exc))) from None
    from runtime.llm.api import LLM

    print("loading model ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(**engine_options(args))
    except ValueError as exc:
        raise UsageError(_flagged(str(exc))) from None
    return llm, params


def _prompt_error(llm, exc: ValueError) -> UsageError:
    """A refused prompt as a usage error that names the flags to change. A prompt plus
    --max-tokens past the context (the engine refuses it rather than cut the answer short) is
    fixed first by --max-tokens: a bigger --max-model-len costs KV cache, and the model may
    already be at its own limit."""
    message = _flagged(str(exc))
    model_max = getattr(llm.engine.loaded.config, "max_position_embeddings", None)
    can_raise = bool(model_max and llm.engine.max_model_len < model_max)
    if message.startswith("--max-tokens must be at most"):
        message += "; lower --max-tokens" + (
            f", or raise --max-model-len (this model takes up to {model_max})" if can_raise else ""
        )
    elif "--max-model-len" in message and can_raise:
        message += f"; raise the limit with --max-model-len (this model takes up to {model_max})"
    return UsageError(message)


def _stream(llm, prompt, params, stop: threading.Event | None = None) -> tuple[str, bool]:
    """Print the answer as it arrives; (text, whether it ran to its end). Setting `stop` ends
    it between two tokens: closing the stream aborts the request and frees its KV blocks."""
    text = []
    out = None
    stream = llm.stream(prompt, params)
    try:
        for out in stream:
            if out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                text.append(out.delta_text)
            if stop is not None and stop.is_set():
                break
    except ValueError as exc:
        raise _prompt_error(llm, exc) from None
    finally:
        stream.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is None or not out.finished:
        print("[stopped]", file=sys.stderr, flush=True)
        return "".join(text), False
    m = out.metrics
    ttft = m.time_to_first_token or 0.0
    rate = m.decode_tokens_per_s
    print(
        f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, TTFT {ttft * 1000:.0f} ms"
        + (f", {rate:.1f} tokens/s]" if rate else "]"),
        file=sys.stderr,
    )
    return "".join(text), True


def run_generate(args) -> int:
    try:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not prompt.strip():
            raise UsageError("the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
        llm, params = load_llm(args)
        if not args.no_chat_template and getattr(llm.tokenizer, "chat_template", None):
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        _stream(llm, prompt, params)
    except UsageError as exc:
        print(f"tandem generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntandem generate: interrupted", file=sys.stderr)
        return 130
    return 0


def _history_file() -> str:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return os.path.join(root, "chat_history")


def _line_editing() -> str | None:
    """Readline editing and history for input(); the history file, or None without readline.
    Readline also reads the line itself (the terminal is not in canonical mode meanwhile),
    so a pasted line is not cut at the kernel's 4,095-character line limit."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return None
    path = _history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return path


def _save_history(path: str | None) -> None:
    if path is None:
        return
    import readline

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        readline.write_history_file(path)
    except OSError:
        pass  # history is a convenience, never a reason to fail


def run_chat(args) -> int:
    try:
        llm, params = load_llm(args)
    except UsageError as exc:
        print(f"tandem chat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntandem chat: interrupted", file=sys.stderr)
        return 130
    history_path = _line_editing()
    history: list[dict] = []
    print("Chat with the model. Ctrl-C stops an answer; an empty line, Ctrl-D or Ctrl-C twice ends.", file=sys.stderr)
    last_was_interrupt = False
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                sys.stdout.write("\n")
                break
            except KeyboardInterrupt:
                if last_was_interrupt:
                    sys.stdout.write("\n")
                    break
                last_was_interrupt = True
                print("\n(Ctrl-C again or Ctrl-D to leave)", file=sys.stderr, flush=True)
                continue
            last_was_interrupt = False
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            stop = threading.Event()
            # SIGINT only sets a flag while an answer streams: an exception raised inside an
            # engine step could leave the step half done; the flag stops it between tokens.
            previous = signal.signal(signal.SIGINT, lambda *_, stop=stop: stop.set())
            try:
                answer, finished = _stream(llm, llm.apply_chat_template(history), params, stop)
            except UsageError as exc:
                print(f"error: {exc}", file=sys.stderr)
                history.pop()
                continue
            finally:
                signal.signal(signal.SIGINT, previous)
            history.append({"role": "assistant", "content": answer})
            last_was_interrupt = not finished
    finally:
        _save_history(history_path)
    return 0
