"""LLM generation: loader, model, runner and sampler (torch), engine and the vLLM-style API."""
