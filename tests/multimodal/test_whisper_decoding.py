"""multimodal/whisper_decoding.py: decoder prompts equal transformers' (generate's init tokens, the
tokenizer's prefix tokens and ``get_prompt_ids``) on the real tiny.en and base tokenizers;
``WhisperLogitsRules`` equals transformers' Whisper logits processors on random logits and histories;
``parse_segments`` splits, times and closes segments."""

from __future__ import annotations

import copy
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.loader import whisper_packages
from engine.loader.ct2 import (ct2_whisper_generation_config, default_whisper_token_ids, load_ct2_tokenizer,
                               read_whisper_token_ids)
from engine.loader.whisper_packages import WhisperModelUnavailable, whisper_model_dir
from multimodal.whisper_decoding import (WhisperLogitsRules, build_decoder_prompt, compression_ratio,
                                         language_detection_prompt, language_from_token, language_name,
                                         language_token_ids, parse_segments, resolve_language, text_of)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------- real tokenizers

def _whisper_dir(name: str) -> Path:
    try:
        return whisper_model_dir(name)
    except WhisperModelUnavailable as e:
        pytest.skip(f"Whisper {name} is not installed (`{whisper_packages.install_command(name)}`): {e}")


@pytest.fixture(scope="module", params=["tiny.en", "base"])
def model(request):
    """(name, WhisperTokenIds, our tokenizer, transformers' WhisperTokenizer) of a real Whisper."""
    from transformers import WhisperTokenizer

    directory = _whisper_dir(request.param)
    return SimpleNamespace(name=request.param, ids=read_whisper_token_ids(directory),
                           tokenizer=load_ct2_tokenizer(directory),
                           hf_tokenizer=WhisperTokenizer.from_pretrained(str(directory)))


def hf_generation_config(ids):
    """``ct2_whisper_generation_config`` for a model with these token ids (what the engine's tests load)."""
    config = SimpleNamespace(
        decoder_start_token_id=ids.sot, bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot,
        suppress_tokens=[], begin_suppress_tokens=[220, ids.eot], alignment_heads=[[0, 0]],
        no_timestamps_token_id=ids.no_timestamps, prev_sot_token_id=ids.start_of_prev,
        is_multilingual=ids.is_multilingual, max_target_positions=448,
        lang_to_id={f"<|{code}|>": i for code, i in ids.language_ids.items()},
        task_to_id={"translate": ids.translate, "transcribe": ids.transcribe})
    return ct2_whisper_generation_config(config)


def hf_decoder_prompt(model, language, task, timestamps, prompt_text=None) -> list[int]:
    """The decoder_input_ids transformers' ``WhisperForConditionalGeneration.generate`` builds (short form,
    ``prompt_ids`` from the tokenizer's ``get_prompt_ids``), without running a model."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin as Mixin

    fake_model = SimpleNamespace(device=torch.device("cpu"),
                                 config=SimpleNamespace(vocab_size=model.ids.vocab_size))
    config = copy.deepcopy(hf_generation_config(model.ids))
    Mixin._set_return_timestamps(fake_model, return_timestamps=timestamps, is_shortform=True,
                                 generation_config=config)
    Mixin._set_language_and_task(language=language, task=task, is_multilingual=None, generation_config=config)
    init = Mixin._retrieve_init_tokens(fake_model, None, batch_size=1, generation_config=config,
                                       config=SimpleNamespace(forced_decoder_ids=None),
                                       num_segment_frames=3000, kwargs={})
    prompt = [] if prompt_text is None else model.hf_tokenizer.get_prompt_ids(prompt_text).tolist()
    return prompt + init[0].tolist()


# ------------------------------------------------------------------------------------------ prompts

@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("prompt_text", [None, "  Mr. Quilter, the apostle.  "])
def test_prompt_matches_transformers_generate(model, timestamps, prompt_text):
    ids = model.ids
    if ids.is_multilingual:
        cases = [("de", "transcribe", "de"), ("German", "translate", "german"), ("EN", "transcribe", "en")]
    else:
        cases = [(None, "transcribe", None), ("en", "transcribe", None), ("English", "transcribe", None)]
    for language, task, hf_language in cases:
        ours = build_decoder_prompt(ids, model.tokenizer, language=language, task=task, timestamps=timestamps,
                                    prompt_text=prompt_text)
        hf_task = task if ids.is_multilingual else None       # transformers refuses a task on English-only
        hf = hf_decoder_prompt(model, hf_language, hf_task, timestamps, prompt_text)
        assert ours == hf, (language, task)
        model.hf_tokenizer.set_prefix_tokens(language=hf_language, task=hf_task,
                                             predict_timestamps=timestamps)
        assert ours[-len(model.hf_tokenizer.prefix_tokens):] == model.hf_tokenizer.prefix_tokens


def test_prompt_layouts(model):
    ids, tok = model.ids, model.tokenizer
    if ids.is_multilingual:   # base
        assert build_decoder_prompt(ids, tok, language="fr", task="translate", timestamps=False) == \
            [50258, ids.language_ids["fr"], 50358, 50363]
        assert build_decoder_prompt(ids, tok, language="de", timestamps=True) == [50258, 50261, 50359]
    else:                     # tiny.en: sot, notimestamps; no language, no task
        assert build_decoder_prompt(ids, tok, language=None, timestamps=False) == [50257, 50362]
        assert build_decoder_prompt(ids, tok, language="en", timestamps=True) == [50257]
    language = "en" if ids.is_multilingual else None
    with_prompt = build_decoder_prompt(ids, tok, language=language, prompt_text="hello there")
    assert with_prompt[0] == ids.start_of_prev
    assert with_prompt[1:with_prompt.index(ids.sot)] == tok.encode(" hello there", add_special_tokens=False)
    # blank previous text is no prompt
    assert build_decoder_prompt(ids, tok, language=language, prompt_text="  ") == \
        build_decoder_prompt(ids, tok, language=language)


def test_prompt_keeps_last_223_tokens(model):
    ids, tok = model.ids, model.tokenizer
    text = " ".join(f"word{i}" for i in range(400))
    full = tok.encode(" " + text, add_special_tokens=False)
    assert len(full) > 223
    language = "en" if ids.is_multilingual else None
    prompt = build_decoder_prompt(ids, tok, language=language, prompt_text=text)
    sot_at = prompt.index(ids.sot)
    assert prompt[0] == ids.start_of_prev and prompt[1:sot_at] == full[-223:]
    short = build_decoder_prompt(ids, tok, language=language, prompt_text=text, max_prompt_tokens=5)
    assert short[1:short.index(ids.sot)] == full[-5:]


def test_prompt_errors(model):
    ids, tok = model.ids, model.tokenizer
    language = "en" if ids.is_multilingual else None
    with pytest.raises(ValueError, match="Unknown language 'klingon'"):
        build_decoder_prompt(ids, tok, language="klingon")
    with pytest.raises(ValueError, match="Unknown task"):
        build_decoder_prompt(ids, tok, language=language, task="summarize")
    with pytest.raises(ValueError, match="special token '<\\|notimestamps\\|>'"):
        build_decoder_prompt(ids, tok, language=language, prompt_text="say <|notimestamps|> now")
    with pytest.raises(ValueError, match="special token '<\\|1.00\\|>'"):
        build_decoder_prompt(ids, tok, language=language, prompt_text="at <|1.00|>")
    if ids.is_multilingual:
        with pytest.raises(ValueError, match="needs the language"):
            build_decoder_prompt(ids, tok, language=None)
    else:
        with pytest.raises(ValueError, match="English-only and cannot transcribe German"):
            build_decoder_prompt(ids, tok, language="de")
        with pytest.raises(ValueError, match="English-only and cannot translate"):
            build_decoder_prompt(ids, tok, language=None, task="translate")


def test_languages():
    english_only, multilingual = default_whisper_token_ids(51864), default_whisper_token_ids(51865)
    assert resolve_language(multilingual, " German ") == "de"
    assert resolve_language(multilingual, "mandarin") == "zh"
    assert resolve_language(multilingual, "DE") == "de"
    assert resolve_language(multilingual, None) is None
    assert resolve_language(english_only, "english") == "en"
    assert language_name("en") == "english" and language_name("de") == "german"
    assert language_detection_prompt(multilingual) == [50258]
    tokens = language_token_ids(multilingual)
    assert tokens == list(range(50259, 50259 + 99)) and len(multilingual.language_ids) == 99
    assert language_from_token(multilingual, 50261) == "de"
    with pytest.raises(ValueError, match="not a language token"):
        language_from_token(multilingual, multilingual.transcribe)
    with pytest.raises(ValueError, match="no Cantonese"):     # yue is large-v3's 100th language
        resolve_language(multilingual, "cantonese")


# ------------------------------------------------------------------------------------- logits rules

def rules_for(ids):
    """Rules with a suppress list shaped like the real ones (symbols, then the task/special tokens)."""
    suppress = list(range(1, 200, 7)) + [ids.sot, ids.translate, ids.transcribe, ids.start_of_lm,
                                         ids.start_of_prev, ids.no_speech]
    return WhisperLogitsRules(ids, suppress, [220, ids.eot]), suppress, [220, ids.eot]


def hf_reference(ids, suppress, begin_suppress, prompt, outputs, scores):
    """transformers' processing of rows that share ``prompt`` and the length of their ``outputs``: the
    processors its Whisper generate builds, in its order, or ``detect_language``'s masking."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor,
                                                        WhisperTimeStampLogitsProcessor)

    scores = scores.clone()
    if ids.is_multilingual and prompt == [ids.sot] and not outputs[0]:
        non_language = torch.ones(scores.shape[-1], dtype=torch.bool)
        non_language[list(ids.language_ids.values())] = False
        scores[:, non_language] = NEG_INF
        return scores
    begin_index = len(prompt)
    processors = [SuppressTokensAtBeginLogitsProcessor(begin_suppress, begin_index),
                  SuppressTokensLogitsProcessor(suppress)]
    if ids.no_timestamps not in prompt:
        processors.append(WhisperTimeStampLogitsProcessor(hf_generation_config(ids), begin_index=begin_index))
    input_ids = torch.tensor([prompt + output for output in outputs])              # [rows, len]
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def history_groups(ids, rng: torch.Generator) -> list[list[list[int]]]:
    """Generated-id histories that reach every branch of the timestamp rules, in groups of one length
    (transformers processes a batch of equal-length rows)."""
    tb = ids.timestamp_begin

    def text(n):
        return torch.randint(0, ids.eot, (n,), generator=rng).tolist()

    def ts(lo, hi):
        return tb + int(torch.randint(lo, hi, (1,), generator=rng))

    return [
        [[]],                                            # first step
        [[tb], [ts(1, 40)]],                             # a lone first timestamp: text must follow
        [[tb] + text(5),                                 # ends in text
         [tb] + text(4) + [ts(30, 60)],                  # one timestamp after text: its pair or eot next
         [tb] + text(1) + [tb + 60, tb + 60] + text(2),  # text after a pair
         [tb] + text(3) + [tb + 75, tb + 75],            # two timestamps: text next
         [tb + 10] + text(1) + [tb + 200, tb + 200] + text(1) + [tb + 700],
         text(6)],                                       # no timestamps at all
    ]


@pytest.mark.parametrize("vocab_size,dtype", [(51864, torch.float32), (51865, torch.bfloat16)])
def test_logits_rules_match_transformers(vocab_size, dtype):
    ids = default_whisper_token_ids(vocab_size)
    rules, suppress, begin_suppress = rules_for(ids)
    rng = torch.Generator().manual_seed(vocab_size)
    lang = [ids.language_ids["en"], ids.transcribe] if ids.is_multilingual else []
    timestamp_prompts = [[ids.sot] + lang, [ids.start_of_prev, 400, 500, 600, ids.sot] + lang]
    plain_prompts = [p + [ids.no_timestamps] for p in timestamp_prompts]
    groups = [(prompt, group) for prompt in timestamp_prompts + plain_prompts
              for group in history_groups(ids, rng)]
    if ids.is_multilingual:
        groups.append(([ids.sot], [[]]))                 # language detection
    prompts = [prompt for prompt, group in groups for _ in group]
    outputs = [output for _, group in groups for output in group]
    logits = torch.randn(len(prompts), vocab_size, generator=rng) * 3              # [R, V]
    logits[::2, ids.timestamp_begin:] += 4.0     # every other row: timestamps likelier than any text token
    logits = logits.to(dtype)
    expected, row = [], 0
    for prompt, group in groups:
        rows = logits[row:row + len(group)]
        expected.append(hf_reference(ids, suppress, begin_suppress, prompt, group, rows))
        row += len(group)
    got = rules.apply(logits.clone(), prompts, outputs)
    assert got.dtype == dtype
    torch.testing.assert_close(got, torch.cat(expected), rtol=0, atol=0)
    # the cases are not vacuous: the probability rule fired in some timestamp rows and not in others
    ts_rows = [i for i, (p, o) in enumerate(zip(prompts, outputs)) if rules.is_timestamp_mode(p) and o]
    text_masked = torch.isinf(got[ts_rows, :ids.eot]).all(dim=-1)
    assert text_masked.any() and not text_masked.all()


def test_logits_rules_modes_and_padding():
    ids = default_whisper_token_ids(51865)
    rules, suppress, _ = rules_for(ids)
    tb = ids.timestamp_begin
    prompts = [[ids.sot], [ids.sot, ids.language_ids["de"], ids.transcribe],
               [ids.sot, ids.language_ids["de"], ids.transcribe, ids.no_timestamps]]
    logits = torch.zeros(3, 51872)                                                   # 7 padding columns
    got = rules.apply(logits, prompts, [[], [], []])
    assert got is logits
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in got]
    assert finite[0] == language_token_ids(ids)                                      # language detection
    assert finite[1] == list(range(tb, tb + 51))                                     # <|0.00|> .. <|1.00|>
    assert ids.no_timestamps in finite[2] and tb in finite[2] and 220 not in finite[2]
    assert torch.isinf(got[:, ids.vocab_size:]).all()                                # padding masked
    assert torch.isinf(got[2, suppress]).all()
    assert [rules.is_timestamp_mode(p) for p in prompts] == [True, True, False]
    with pytest.raises(ValueError, match="outside the 51865-token vocabulary"):
        WhisperLogitsRules(ids, [-1], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logits_rules_cuda_matches_cpu():
    ids = default_whisper_token_ids(51865)
    rules, _, _ = rules_for(ids)
    rng = torch.Generator().manual_seed(0)
    prompt = [ids.sot, ids.language_ids["en"], ids.transcribe]
    outputs = history_groups(ids, rng)[2]
    logits = torch.randn(len(outputs), ids.vocab_size, generator=rng).to(torch.bfloat16)
    cpu = rules.apply(logits.clone(), [prompt] * len(outputs), outputs)
    cuda = rules.apply(logits.cuda(), [prompt] * len(outputs), outputs)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- segments

class WordTokenizer:
    """decode(ids) = the words of ids below 10, in order (ids 10+ never reach it)."""

    WORDS = [" Hello", " world", ".", " How", " are", " you", "?", " Fine", " -->", " ok"]

    def decode(self, token_ids):
        assert all(t < len(self.WORDS) for t in token_ids)
        return "".join(self.WORDS[t] for t in token_ids)


IDS = default_whisper_token_ids(51864)
TB, EOT = IDS.timestamp_begin, IDS.eot


def ts(seconds: float) -> int:
    return TB + round(seconds / 0.02)


def spans(segments):
    return [(s.start_s, s.end_s, s.text) for s in segments]


def parse(token_ids, offset=30.0, end=40.0, **kwargs):
    kwargs.setdefault("logprobs", None)
    kwargs.setdefault("no_speech_prob", None)
    return parse_segments(IDS, WordTokenizer(), token_ids, time_offset_s=offset, chunk_end_s=end, **kwargs)


def test_segments_from_timestamp_pairs_with_offsets():
    token_ids = [ts(0), 0, 1, 2, ts(1.5), ts(1.5), 3, 4, 5, 6, ts(2.98), EOT]
    segments = parse(token_ids, offset=30.0, end=40.0)
    assert spans(segments) == [(30.0, 31.5, " Hello world."), (31.5, 32.98, " How are you?")]
    assert segments[0].token_ids == [ts(0), 0, 1, 2, ts(1.5)]
    assert segments[1].token_ids == [ts(1.5), 3, 4, 5, 6, ts(2.98)]
    assert [s.id for s in segments] == [0, 1] and all(s.seek == 3000 for s in segments)


def test_open_segment_is_closed_at_chunk_end():
    # the window ended mid-segment: " Fine" has an opening timestamp but no closing one
    segments = parse([ts(0), 0, 1, ts(1.0), ts(1.0), 7], offset=10.0, end=17.25)
    assert spans(segments) == [(10.0, 11.0, " Hello world"), (11.0, 17.25, " Fine")]
    # an opener after the window start and no closing timestamp: from the opener to the chunk end
    assert spans(parse([ts(0.5), 0, 1, EOT], offset=0.0, end=3.0)) == [(0.5, 3.0, " Hello world")]
    # an opener later than the chunk end (a hallucinated time): an empty span at the opener, not negative
    assert spans(parse([ts(4.0), 0, EOT], offset=0.0, end=3.0)) == [(4.0, 4.0, " Hello")]


def test_text_without_timestamps_spans_the_chunk():
    assert spans(parse([0, 1, 2, EOT], offset=5.0, end=12.5)) == [(5.0, 12.5, " Hello world.")]
    # one opening <|0.00|> and one closing timestamp (no pair): one segment up to the closing one
    assert spans(parse([ts(0), 0, 1, 2, ts(3.0), EOT], offset=5.0)) == [(5.0, 8.0, " Hello world.")]
    # text after a lone closing timestamp (outside the timestamp rules) starts where the last one ended
    assert spans(parse([0, 1, ts(2.0), 3, 4, EOT], offset=5.0, end=9.0)) == \
        [(5.0, 7.0, " Hello world"), (7.0, 9.0, " How are")]


def test_trailing_opener_joins_previous_segment_and_nothing_is_lost():
    segments = parse([ts(0), 0, 1, ts(1.0), ts(1.0), EOT, 3, 4])   # ids after eot are ignored
    assert spans(segments) == [(30.0, 31.0, " Hello world")]
    assert segments[0].token_ids == [ts(0), 0, 1, ts(1.0), ts(1.0)]
    assert parse([]) == [] and parse([EOT]) == [] and parse([ts(0), EOT]) == []


def test_segment_window_fields():
    token_ids = [ts(0), 0, 1, ts(1.0), ts(1.0), 8, 9, ts(2.0), EOT, 5]
    logprobs = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8, -0.9, -50.0]
    segments = parse(token_ids, logprobs=logprobs, no_speech_prob=0.125, temperature=0.2, first_id=7)
    window_text = " Hello world --> ok"
    expected_ratio = len(window_text.encode()) / len(zlib.compress(window_text.encode()))
    for s in segments:
        assert s.avg_logprob == pytest.approx(-0.5)          # mean up to and with eot, as OpenAI
        assert s.compression_ratio == pytest.approx(expected_ratio) == compression_ratio(window_text)
        assert s.no_speech_prob == 0.125 and s.temperature == 0.2
    assert [s.id for s in segments] == [7, 8]
    assert text_of(IDS, WordTokenizer(), [ts(0), 0, EOT, IDS.sot, 1, ts(1.0)]) == " Hello world"


def test_segments_with_the_real_tokenizer():
    tokenizer = load_ct2_tokenizer(_whisper_dir("tiny.en"))
    hello, fine = (tokenizer.encode(t, add_special_tokens=False) for t in (" Hello world.", " Fine, thanks!"))
    token_ids = [ts(0)] + hello + [ts(1.2), ts(1.2)] + fine + [ts(2.5), EOT]
    segments = parse_segments(IDS, tokenizer, token_ids, None, time_offset_s=0.0, chunk_end_s=4.0,
                              no_speech_prob=None)
    assert spans(segments) == [(0.0, 1.2, " Hello world."), (1.2, 2.5, " Fine, thanks!")]
