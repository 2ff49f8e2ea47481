"""Chat templates rendered by `transformers` itself, for meshwork's `chat.rs`: each case's
template (written in the style of the Hub's Llama 3.1, Qwen 2.5, Qwen 3 and Mistral
templates, and a few that lean on Jinja2's whitespace control, loop controls, namespaces
and Python's string methods), messages and special tokens, and the text
`transformers.utils.chat_template_utils.render_jinja_template(...,
add_generation_prompt=True)` gives after `apply_chat_template`'s own normalization (keys
whose value is None dropped).

    pip install transformers==5.24.0 jinja2
    python3 gen_chat_cases.py OUT.json
"""
import json
import sys

from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

LLAMA31 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- endif %}
{%- endfor %}"""

WHITESPACE = """{% for m in messages %}
  {% if loop.first %}
    [{{ m.role | upper }}]
  {% endif %}
  {{ m.role }}: {{ m.content | trim | replace("  ", " ") }}
  {% if m.role == 'user' %}{% continue %}{% endif %}
  (said {{ m.content | length }} characters)
{% endfor %}
{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}
{{ messages | map(attribute='role') | join(',') }}
{% if add_generation_prompt %}assistant:{% endif %}"""

TOJSON = """{% for m in messages %}{{ m | tojson }}
{{ m | tojson(indent=2) }}
{{ m | tojson(sort_keys=true) }}
{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"""

TOOLS = {"type": "function", "function": {"name": "shard", "description": "Split a tensor.",
         "parameters": {"type": "object", "properties": {"tensor": {"type": "string"},
                                                          "axis": {"type": "integer"}},
                        "required": ["tensor", "axis"]}}}

CHAT = [{"role": "system", "content": "  You shard tensors.  "},
        {"role": "user", "content": "Which axis splits   the batch?"},
        {"role": "assistant", "content": "The data axis.", "tool_calls": None},
        {"role": "user", "content": "And the heads?"}]

TOOL_CHAT = [{"role": "user", "content": "Shard x over model."},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "shard",
                              "arguments": {"tensor": "x", "axis": 1, "mesh": {"model": 2, "data": 4}}}}]},
             {"role": "tool", "content": "{\"shape\": [4, 8]}"},
             {"role": "tool", "content": "ok"}]

THINK_CHAT = [{"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
              {"role": "user", "content": "And 3+3?"},
              {"role": "assistant", "content": "6", "reasoning_content": "add again"},
              {"role": "user", "content": "Thanks ünïcödé 東京"}]

TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# Every message's keys in order (after the reasoning aliasing), and the floats of a
# tool call's arguments as json.dumps writes them.
KEYS = """{% for m in messages %}{{ m | tojson }}|{% for k in m %}{{ k }},{% endfor %}
{% endfor %}{{ eos_token }}"""

REASONING_CHAT = [{"role": "user", "content": "Why?"},
                  {"role": "assistant", "thinking": "B", "content": "own thinking"},
                  {"role": "assistant", "content": "older name", "reasoning": "R"},
                  {"role": "assistant", "reasoning_content": "A", "content": "both", "thinking": "B"},
                  {"role": "assistant", "content": "empty reasoning", "reasoning_content": ""},
                  {"role": "assistant", "content": "null reasoning", "reasoning_content": None,
                   "thinking": "T"},
                  {"role": "tool", "content": "floats",
                   "arguments": {"lr": 1e-07, "wd": 0.1, "big": 1e+20, "one": 1.0, "neg": -2.5e-05,
                                 "n": 3, "text": "caf\u00e9 \u007f"}}]

GENERATION = """{% for m in messages %}{% if m.role == 'assistant' %}
{%- generation %}{{ m.content }}{% endgeneration -%}
{% else %}[{{ m.role }}] {{ m.content }}
{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"""

CASES = [
    ("llama31", LLAMA31, CHAT, TOKENS),
    ("llama31-tool", LLAMA31, TOOL_CHAT[:2], TOKENS),
    ("qwen25", QWEN25, CHAT, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    ("qwen25-tool", QWEN25, TOOL_CHAT, {"eos_token": "<|im_end|>"}),
    ("qwen3-think", QWEN3, THINK_CHAT, {"eos_token": "<|im_end|>"}),
    ("qwen3-think-last", QWEN3, THINK_CHAT[:4], {"eos_token": "<|im_end|>"}),
    ("mistral", MISTRAL, [CHAT[0], CHAT[1], CHAT[2], CHAT[3]], TOKENS),
    ("whitespace", WHITESPACE, CHAT, TOKENS),
    ("tojson", TOJSON, TOOL_CHAT, TOKENS),
    ("reasoning-keys", KEYS, REASONING_CHAT, TOKENS),
    ("generation-tag", GENERATION, CHAT, TOKENS),
]


def main():
    out = []
    for name, template, messages, tokens in CASES:
        chat = _normalize_chat_messages(messages)
        text, _ = render_jinja_template([chat], chat_template=template, add_generation_prompt=True, **tokens)
        out.append({"name": name, "template": template, "messages": messages, "tokens": tokens,
                    "file": json.dumps(messages, ensure_ascii=False), "text": text[0]})
    # A template that raises: the message.
    bad = [CHAT[1], CHAT[1]]
    try:
        render_jinja_template([_normalize_chat_messages(bad)], chat_template=MISTRAL,
                              add_generation_prompt=True, **TOKENS)
        raise SystemExit("the alternation template did not raise")
    except Exception as e:  # noqa: BLE001
        out.append({"name": "mistral-raises", "template": MISTRAL, "messages": bad,
                    "file": json.dumps(bad), "tokens": TOKENS, "raises": str(e)})
    json.dump(out, open(sys.argv[1], "w"), indent=1, ensure_ascii=False)
    print(len(out), "cases")


if __name__ == "__main__":
    main()
