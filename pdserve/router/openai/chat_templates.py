"""Chat templates pdserve ships for built-in models whose own template drops `tools`.

SmolLM2-135M-Instruct's template renders a prompt with tools exactly as without them, so under
tool_choice "auto" the model never learns of a tool. SMOLLM2_TOOLS keeps SmolLM2's own
`<|im_start|>role ... <|im_end|>` format (a conversation without tools renders exactly as with
the GGUF's template) and adds Hermes-style tools:
  * the tools listed as JSON in the system turn, with how to call one:
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the hermes parser reads it). The
    system turn opens as Hermes' function-calling prompt does: introduced instead as "a helpful
    assistant with tools", the model answered "What is the weather in Paris?" in prose (greedy)
    and called on 5 of 8 weather wordings, against 8 of 8 with this opening (chit-chat calls
    nothing either way);
  * one example exchange calling the first tool, because a 135M model given only the instruction
    answers in prose: with the example it copies the call's form (greedy, checked by hand over
    several wordings; see docs/openai.md). Its arguments: an enum's first value, 1 for a number,
    true for a boolean, "..." for anything else. The parameter's name as its value was copied
    as the value itself (`{"ticker": "ticker"}` for "the stock price of AAPL"): over 20 prompts
    with string parameters, 8 such copies and 9 values taken from the question, against 1 and 13
    with "..." (the same calls for 8 of 9 weather questions either way);
  * the assistant's earlier calls as <tool_call> blocks, tool results as a `tool` turn;
  * after a tool result, the tools are left out: the model answers from the result instead of
    calling the tool again (a loop such as LangChain's bind_tools then ends).
"""
from __future__ import annotations

from pdserve.models.gguf import DEFAULT_MODEL

SMOLLM2_TOOLS = """{%- set answering = messages[-1].role == 'tool' %}
{%- if tools and not answering %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'You are a function calling AI model. You may call one or more functions to assist with the user query. The functions:\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>\\nTo call a tool, reply with <tool_call>{"name": "' + tools[0].function.name + '", "arguments": {...}}</tool_call>.<|im_end|>\\n' }}{%- set f = tools[0].function %}{%- set ns = namespace(args='') %}{%- for k, v in ((f.parameters or {}).properties or {}).items() %}{%- set val = (v.enum[0] | tojson) if v.enum is defined else ('1' if v.type in ('integer', 'number') else ('true' if v.type == 'boolean' else '"..."')) %}{%- set ns.args = ns.args + (', ' if ns.args else '') + '"' + k + '": ' + val %}{%- endfor %}{{- '<|im_start|>user\\nUse the ' + f.name + ' tool.<|im_end|>\\n<|im_start|>assistant\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": {' + ns.args + '}}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools and not answering %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
{%- for call in message.tool_calls %}{%- set f = call.function if call.function is defined else call %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}
{%- if not loop.last %}{{- '\\n' }}{%- endif %}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

BUILTIN_TEMPLATES = {DEFAULT_MODEL: SMOLLM2_TOOLS}


def builtin_chat_template(model: str) -> str | None:
    """pdserve's own chat template for `model` (a built-in model named as `--model` names it)."""
    return BUILTIN_TEMPLATES.get(model)
