"""The LLM's command-line flags, defined once for every command that takes them: `tandem
generate` and `tandem chat` (engine and sampling flags), `tandem worker` and `tandem serve
--embedded` (engine flags). argparse only: importing this loads no torch."""

from __future__ import annotations

import argparse

from schedulers.config import POLICIES

# Flag name -> EngineConfig field; the flags' dest names are the fields' names.
ENGINE_FIELDS = (
    "model",
    "dtype",
    "device",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "kv_cache_bytes",
    "quantization",
    "enforce_eager",
    "speculative_config",
    "policy",
)


def _json_object(text: str) -> dict:
    """--speculative-config's value: a JSON object (argparse reports the error with the flag)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_engine_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="weight and KV cache type (auto: bfloat16 on CPUs with AMX or AVX512-BF16 and on GPUs, else float32)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default: 16 on CPU, 256 on GPU)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step (default: 256 on CPU, 2048 on GPU)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + answer in tokens (default: the model's, capped at 2048)",
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="KV cache size (default: the rest of the device budget)"
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["float", "gguf", "int4"],
        help="default: as the model ships (gguf for a .gguf file on CPU, else float); gguf: a .gguf model's "
        "Q4_1/Q8_0 layers kept as shipped, read by Tandem's integer kernel (CPU); float: weights in --dtype "
        "(a GGUF dequantized); int4: the layers requantized for torch's 4-bit kernel (CPU, bfloat16)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="eager steps only (the default); --no-enforce-eager: decode steps run a captured graph once it "
        "compiles, in the background (CPU: torch.compile; CUDA: CUDA graphs); BENCHMARKS.md",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='draftless speculative decoding, vLLM\'s dict: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off). Helps one or a few users on text '
        "that repeats its input (summaries, extraction, edits); exact for greedy requests; README",
    )

    p.add_argument(
        "--policy",
        default=None,
        choices=list(POLICIES),
        help="who runs first: fcfs (the default), priority (lower first, aged one level per 10 s of wait so "
        "nothing waits forever) or fair (per-tenant Virtual Token Counters: a tenant that floods the queue "
        "gets its share, not every slot)",
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the flags set (those left unset keep the engine's defaults)."""
    values = {name: getattr(args, name) for name in ENGINE_FIELDS}
    return {k: v for k, v in values.items() if v is not None}


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop token may end")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 makes tokens of the prompt and answer less likely (1 = off)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from tokens already generated, in [-2, 2] (0 = off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted per earlier occurrence in the answer, in [-2, 2] (0 = off)",
    )
    p.add_argument("--seed", type=int, default=None, help="per-request seed, for repeatable sampling")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the answer at TEXT (not printed); repeat for several",
    )
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def add_llm_arguments(p: argparse.ArgumentParser) -> None:
    """Engine and sampling flags: `tandem generate` and `tandem chat`."""
    add_engine_arguments(p)
    add_sampling_arguments(p)


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags; ValueError names the field."""
    from runtime.llm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        min_tokens=args.min_tokens,
        stop=list(args.stop or []),
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
