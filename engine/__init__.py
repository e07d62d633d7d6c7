"""Chorus engine: paged KV cache, one token-budget scheduler, offline and async APIs."""

from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import engine` stays cheap.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
