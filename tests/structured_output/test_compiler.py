"""The compile pool: cached by spec and tokenizer, failures carry the compiler's reason and the request
field to blame, concurrent submits of one spec share one compilation."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from engine.structured_output.compiler import GrammarCompilePool, tokenizer_fingerprint
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.spec import GrammarSpec
from tests.structured_output.utils import SMOL_VOCAB_SIZE, smol_tokenizer, tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def pool():
    pool = GrammarCompilePool.for_tokenizer(smol_tokenizer(), SMOL_VOCAB_SIZE, backend="auto")
    yield pool
    pool.shutdown()


def test_second_compile_is_a_cache_hit(pool):
    first = pool.submit(StructuredOutputsParams(json=SCHEMA)).result()
    hits, misses = pool.cache_hits, pool.cache_misses
    pool.validate(StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}, '
                                               '"required": ["a"]}'))
    assert (pool.cache_hits, pool.cache_misses) == (hits + 1, misses)
    assert pool.submit(GrammarSpec.from_params(StructuredOutputsParams(json=SCHEMA))).result() is first
    other = pool.submit(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)).result()
    assert other is not first and pool.cache_misses == misses + 1


def test_failure_is_cached_with_its_reason_and_param(pool):
    bad = StructuredOutputsParams(regex="(unclosed")
    with pytest.raises(StructuredOutputError, match="The parenthesis is not closed") as info:
        pool.validate(bad)
    assert info.value.param == "structured_outputs" and info.value.backend == "xgrammar"
    misses = pool.cache_misses
    with pytest.raises(StructuredOutputError) as info:
        pool.validate(bad, param="response_format")
    assert info.value.param == "response_format" and pool.cache_misses == misses
    with pytest.raises(StructuredOutputError, match="The parenthesis is not closed"):
        pool.submit(bad).result()


def test_concurrent_submits_share_one_compilation(pool):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"z": {"type": "string"}}})
    futures: list[Future] = []
    barrier = threading.Barrier(4)

    def submit():
        barrier.wait()
        futures.append(pool.submit(params))

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(f) for f in futures}) == 1
    assert futures[0].result().backend == "xgrammar"


def test_unexpected_failure_is_not_cached():
    class Flaky:
        name, vocab_size = "flaky", 64
        calls = 0

        def compile(self, spec):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise MemoryError("transient")
            return "compiled"

    pool = GrammarCompilePool(Flaky(), tokenizer_id="t")
    params = StructuredOutputsParams(regex="a")
    with pytest.raises(MemoryError):
        pool.submit(params).result()
    assert pool.cache_size() == 0
    assert pool.submit(params).result() == "compiled" and Flaky.calls == 2
    pool.shutdown()


def test_cache_is_bounded_and_keys_on_the_tokenizer():
    class Echo:
        name, vocab_size = "echo", 64

        def compile(self, spec):
            return spec.text

    pool = GrammarCompilePool(Echo(), tokenizer_id="t", max_cached=2)
    for regex in ("a", "b", "c"):
        pool.validate(StructuredOutputsParams(regex=regex))
    assert pool.cache_size() == 2
    spec = GrammarSpec.from_params(StructuredOutputsParams(regex="a"))
    assert pool.cache_key(spec) != GrammarCompilePool(Echo(), tokenizer_id="u").cache_key(spec)
    pool.shutdown()
    tok = tiny_tokenizer()
    assert tokenizer_fingerprint(tok, 384) == tokenizer_fingerprint(tok, 384)
    assert tokenizer_fingerprint(tok, 384) != tokenizer_fingerprint(tok, 416)
    assert tokenizer_fingerprint(tok, 384) != tokenizer_fingerprint(tok, 384, stop_token_ids=[0])


GOOD = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[a-z]+-[0-9]{2}"), StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "a" root | "b"'),
        StructuredOutputsParams(grammar='start: "x"+'),                                   # Lark: guidance
        StructuredOutputsParams(json={"type": "object", "minProperties": 1})]            # guidance
BAD = [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
       StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
       StructuredOutputsParams(regex="(a"), StructuredOutputsParams(grammar="root ::= missing"),
       StructuredOutputsParams(structural_tag='{"structures": "x", "triggers": []}')]


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_a_check_only_pool_refuses_what_compiling_refuses_and_compiles_nothing(backend, monkeypatch):
    """The API process's copy of the pool (``--engine-process``: a pickled pool is ``check_only``) parses
    specs: a spec the compiler refuses is refused with the same reason and field, a good one passes, and
    nothing is compiled (the engine process compiles each spec once)."""
    import pickle

    compiling = GrammarCompilePool.for_tokenizer(smol_tokenizer(), SMOL_VOCAB_SIZE, backend=backend)
    checking = pickle.loads(pickle.dumps(compiling))
    assert checking.check_only and not compiling.check_only
    try:
        reasons = {}
        for params in BAD + GOOD:
            try:
                compiling.validate(params, param="response_format")
            except StructuredOutputError as e:
                reasons[repr(params)] = e
        assert len(reasons) >= len(BAD), reasons
        monkeypatch.setattr(type(checking.backend), "compile", lambda *a: pytest.fail("compiled"), raising=False)
        for params in BAD + GOOD:
            expected = reasons.get(repr(params))
            if expected is None:
                checking.validate(params)
                continue
            with pytest.raises(StructuredOutputError) as info:
                checking.validate(params, param="response_format")
            assert (str(info.value), info.value.param) == (str(expected), expected.param)
    finally:
        compiling.shutdown()
        checking.shutdown()
