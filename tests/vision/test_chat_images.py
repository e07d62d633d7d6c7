"""Offline ``LLM.chat`` with image content parts (PIL, file path, data URL, two images) gives what
``LLM.generate`` gives for the rendered prompt and the same images; malformed parts are ValueErrors."""

from __future__ import annotations

import base64
import io

import pytest

from engine.chat_utils import parse_chat_messages
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    return LLM(str(tiny_llava_dir), device="cpu", dtype="float32", max_num_seqs=8)


def render(llm: LLM, content: list[dict]) -> str:
    """The reference prompt: transformers' own apply_chat_template over template parts."""
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)


def test_chat_image_sources_equal_generate(llava, images, tmp_path):
    """PIL (image_pil), a path (image), a data URL and a path (image_url): one conversation each, in one
    batch; the reference is generate() on the rendered prompts, batched the same way."""
    path = tmp_path / "img.png"
    images[1].save(path)
    parts = [{"type": "image_pil", "image_pil": images[0]},
             {"type": "image", "image": str(path)},
             {"type": "image_url", "image_url": {"url": data_url(images[2])}},
             {"type": "image_url", "image_url": str(path)}]   # vLLM's short form, a plain path offline
    refs = [images[0], images[1], images[2], images[1]]
    convs = [[{"role": "user", "content": [part, {"type": "text", "text": "What is in the picture?"}]}]
             for part in parts]
    outs = llava.chat(convs, params(), use_tqdm=False)
    template_content = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
    text = render(llava, template_content)
    assert text.count("<image>") == 1
    want = llava.generate([{"prompt": text, "multi_modal_data": {"image": img}} for img in refs], params(),
                          use_tqdm=False)
    for out, ref in zip(outs, want, strict=True):
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert len(out.prompt_token_ids) > len(llava.get_tokenizer().encode(text))   # placeholders expanded
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
    # The images matter: a different image gives a different continuation's likelihood.
    assert outs[0].outputs[0].cumulative_logprob != outs[2].outputs[0].cumulative_logprob


def test_two_images_in_one_message(llava, images):
    content = [{"type": "text", "text": "Hello"}, {"type": "image_pil", "image_pil": images[0]},
               {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": data_url(images[3])}},
               {"type": "text", "text": " again"}]
    conv = [{"role": "system", "content": "You describe images."}, {"role": "user", "content": content}]
    out = llava.chat(conv, params(), use_tqdm=False)[0]
    text = llava.get_tokenizer().apply_chat_template(
        [conv[0], {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image"},
                                                {"type": "text", "text": " and "}, {"type": "image"},
                                                {"type": "text", "text": " again"}]}],
        tokenize=False, add_generation_prompt=True)
    assert "Hello<image> and <image> again" in text
    ref = llava.generate({"prompt": text, "multi_modal_data": {"image": [images[0], images[3]]}}, params(),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # Swapping the images changes the result: they are placed in order.
    swapped = llava.generate({"prompt": text, "multi_modal_data": {"image": [images[3], images[0]]}}, params(),
                             use_tqdm=False)[0]
    assert swapped.outputs[0].cumulative_logprob != out.outputs[0].cumulative_logprob


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url"}, "messages[0].content[0]: an image_url part needs 'image_url'"),
    ({"type": "image_url", "image_url": {"url": ""}}, "a non-empty string"),
    ({"type": "image_pil", "image_pil": "not a PIL image"}, "an image_pil part needs 'image_pil', a PIL image"),
    ({"type": "image"}, "an image part needs 'image'"),
    ({"type": "input_audio", "input_audio": {}}, "this model does not take audio"),
    ({"type": "text"}, "a text part needs 'text'"),
    ({"text": "no type"}, "a content part needs a 'type'"),
    ("just a string", "a content part must be a dict"),
])
def test_malformed_part_is_value_error(llava, part, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        llava.chat([{"role": "user", "content": [part]}], params(), use_tqdm=False)


def test_bad_image_and_placeholder_errors(llava, images, tmp_path):
    with pytest.raises(ValueError, match="image file not found"):
        llava.chat([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "nope.png")}]}],
                   params(), use_tqdm=False)
    with pytest.raises(ValueError, match="not an image in a supported format"):
        llava.chat([{"role": "user", "content": [{"type": "image", "image": b"\x00" * 64}]}], params(),
                   use_tqdm=False)
    # A literal placeholder typed in the text is one placeholder too many for the images given.
    with pytest.raises(ValueError, match="2 image placeholder"):
        llava.chat([{"role": "user", "content": [{"type": "text", "text": "<image>"},
                                                 {"type": "image_pil", "image_pil": images[0]}]}],
                   params(), use_tqdm=False)
    assert not llava.llm_engine.has_unfinished_requests()


def test_parse_chat_messages_shapes():
    parsed = parse_chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]},
                                  {"role": "assistant", "content": None, "name": "bot"}], takes_images=False)
    assert parsed.messages == [{"role": "user", "content": "a\nb"},
                               {"role": "assistant", "content": "", "name": "bot"}]
    assert parsed.images == []
    url = "https://example.com/cat.png"
    parsed = parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                               {"type": "text", "text": "cat?"}]}],
                                 takes_images=True)
    assert parsed.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "cat?"}]}]
    assert parsed.images == [url]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: this model does not take images"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": url}]}],
                            takes_images=False)
    with pytest.raises(ValueError, match="only accepted by the offline LLM.chat"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image", "image": url}]}], takes_images=True)
    with pytest.raises(ValueError, match=r"messages\[0\].content: expected a string or a list"):
        parse_chat_messages([{"role": "user", "content": 5}], takes_images=True)


def test_adjacent_images(llava, images):
    image_token_id = llava.get_tokenizer().convert_tokens_to_ids("<image>")
    one = llava.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]}]}], params(),
                     use_tqdm=False)[0]
    two = llava.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                                   {"type": "image_pil", "image_pil": images[1]}]}], params(),
                     use_tqdm=False)[0]
    assert two.prompt_token_ids.count(image_token_id) == 2 * one.prompt_token_ids.count(image_token_id)
