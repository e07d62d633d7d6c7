"""One chat renderer (``engine/chat_render.py``): the server's path (``render_chat_off_loop``, then the
processor, as ``AsyncLLM.add_request`` runs it) and ``LLM.chat`` give the same token ids for the same
messages, text-only and with images; a chat is tokenized once; an image's encoder-cache key is final when
``Processor.process`` returns, under the adapter's name when the adapter updates the encoder."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving_chat import render_chat_off_loop
from lora.adapter_uploads import AdapterUploads
from lora.request import LoRARequest


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def conversation(image_urls: list[str]) -> list[dict]:
    """System, a user turn (its images first), an assistant turn and a last user turn."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": parts + [{"type": "text", "text": "What is in the picture?"}]},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": [{"type": "text", "text": "And its color?"}]}]


def server_path(llm: LLM, messages: list[dict], **options):
    """The server's render (in its worker pool, with its checks), then ``Processor.process``: the children
    the engine gets for a /v1/chat/completions request."""
    processor = llm.llm_engine.processor
    req = ChatCompletionRequest(model="m", messages=messages, **options)
    rendered = asyncio.run(render_chat_off_loop(SimpleNamespace(processor=processor), req, False))
    _, children = processor.process("server", rendered.engine_prompt(), params())
    return rendered, children


@pytest.fixture(scope="module")
def llms(tiny_llama_dir, tiny_llava_dir, tiny_qwen2_vl_dir):
    kwargs = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=512)
    return {"llama": LLM(str(tiny_llama_dir), **kwargs), "llava": LLM(str(tiny_llava_dir), **kwargs),
            "qwen2_vl": LLM(str(tiny_qwen2_vl_dir), **kwargs)}


@pytest.mark.parametrize("family", ["llama", "llava", "qwen2_vl"])
def test_server_path_and_llm_chat_give_the_same_token_ids(llms, images, family):
    llm = llms[family]
    urls = [] if family == "llama" else [data_url(images[0]), data_url(images[1])]
    messages = conversation(urls)
    rendered, children = server_path(llm, messages)
    out = llm.chat(messages, params(), use_tqdm=False)[0]
    assert out.prompt == rendered.text
    assert out.prompt_token_ids == children[0].prompt_token_ids
    if urls:   # placeholders expanded the same way, the same images keyed the same way
        assert len(out.prompt_token_ids) > len(rendered.token_ids)
        assert len(children[0].mm_features) == 2
    # Continuing the final (assistant) message: the same text and ids both ways.
    partial = messages[:3]
    rendered, children = server_path(llm, partial, add_generation_prompt=False, continue_final_message=True)
    out = llm.chat(partial, params(), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert rendered.text.endswith("A square.")
    assert out.prompt == rendered.text and out.prompt_token_ids == children[0].prompt_token_ids


def test_a_chat_is_tokenized_once(llms, images, monkeypatch):
    """Every tokenizer entry (``encode``, ``__call__``) goes through ``_encode_plus``: one call per chat,
    on the rendered text, on the server's path and in ``LLM.chat``; the processor tokenizes nothing."""
    llm = llms["llava"]
    tokenizer = llm.llm_engine.processor.chat_renderer.tokenizer
    texts: list[str] = []
    real = tokenizer._encode_plus

    def counting(text, *args, **kwargs):
        texts.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "_encode_plus", counting)
    messages = conversation([data_url(images[0])])
    rendered, _ = server_path(llm, messages)
    assert texts == [rendered.text]
    texts.clear()
    llm.chat([messages, messages], params(), use_tqdm=False)
    assert texts == [rendered.text, rendered.text]


class _Reader:
    """An ``AdapterReader`` stand-in: an adapter named ``enc*`` updates the encoder, any other does not."""

    def read(self, lora_request: LoRARequest):
        return SimpleNamespace(adapts_encoder=lora_request.lora_name.startswith("enc"))


def test_image_key_is_final_after_process_and_carries_an_encoder_adapter(tiny_llava_dir, images, monkeypatch):
    """Under an adapter that updates the encoder an image has its own encoder-cache key (decided by the
    processor, from what the client read); under one that does not, and with no adapter, the content
    hash alone; the engine core keeps the key as the processor made it."""
    from engine.core_messages import AddRequest

    llm = LLM(str(tiny_llava_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
              max_model_len=256)
    processor = llm.llm_engine.processor
    monkeypatch.setattr(processor, "adapter_uploads", AdapterUploads(_Reader()))
    prompt = {"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "multi_modal_data": {"image": images[0]}}
    enc, dec = LoRARequest("enc", 1, "/enc"), LoRARequest("dec", 2, "/dec")
    many = SamplingParams(max_tokens=1, n=2)

    def keys(rid, lora, p=params()):
        _, children = processor.process(rid, prompt, p, lora)
        return children, [(f.identifier, f.encoder_lora_name) for c in children for f in c.mm_features]

    _, base = keys("base", None)
    (content_hash, _), = base
    assert base == [(content_hash, None)]
    assert keys("dec", dec)[1] == [(content_hash, None)]
    children, under_enc = keys("enc", enc, many)
    assert under_enc == [(f"{content_hash}+lora:enc#1", "enc")] * 2
    assert keys("enc-again", enc)[1] == [(f"{content_hash}+lora:enc#1", "enc")]   # from the record, no read
    # A record marked sent without a read (the engine reads that adapter): keyed under it, right either way.
    processor.adapter_uploads.mark_sent(LoRARequest("other", 3, "/other"))
    assert keys("other", LoRARequest("other", 3, "/other"))[1] == [(f"{content_hash}+lora:other#3", "other")]
    # The core queues the processor's key as it is.
    core = llm.llm_engine.core
    monkeypatch.setattr(core.lora_manager, "register", lambda *args, **kwargs: False)
    core.add_request(AddRequest("enc", children))
    assert [core.scheduler.requests[c.request_id].mm_features[0].identifier for c in children] == \
        [f"{content_hash}+lora:enc#1"] * 2
    core.abort_requests([c.request_id for c in children])
