"""Chat templates of each family's tool calling and thinking, for the tiny checkpoints.

Written for hetserve: each renders what the family's published template renders for tools,
tool calls, tool results and thinking (the markers, their order and the generation prompt),
so the tool and reasoning parsers are tested on the text a real checkpoint's template makes
and its model was trained to emit. Each template uses only `{%- -%}` and explicit '\\n' so
that its output does not depend on the environment's whitespace options.

`FORMATS[name]`: the template, the marker tokens the tokenizer must have as single tokens
(with whether the published tokenizer marks them special), and the end-of-turn tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

NL = "{{- '\\n' -}}"


def _args(tc: str = "tc") -> str:
    # Arguments may come as a JSON string (OpenAI's shape) or a mapping (vLLM parses them).
    return (
        f"{{% if {tc}.function.arguments is string -%}}{{{{- {tc}.function.arguments -}}}}"
        f"{{%- else -%}}{{{{- {tc}.function.arguments | tojson -}}}}{{%- endif -%}}"
    )


_SYSTEM_FIRST = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none -%}"
)

# Qwen3 (and Qwen2.5, Hermes): ChatML; tools as JSON lines inside <tools>, calls as JSON in
# <tool_call>, results as <tool_response> in a user turn; thinking in <think> (an empty one
# in the generation prompt turns it off).
QWEN3 = (
    _SYSTEM_FIRST + "{%- if tools -%}<|im_start|>system" + NL + "{%- if sys -%}{{- sys -}}"
    "" + NL + NL + "{%- endif -%}# Tools" + NL + NL + "You may call one or more functions to "
    "assist with the user query." + NL + NL + "You are provided with function signatures "
    "within <tools></tools> XML tags:" + NL + "<tools>"
    "{%- for t in tools -%}" + NL + "{{- t | tojson -}}{%- endfor -%}" + NL + "</tools>"
    "" + NL + NL + "For each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:" + NL + "<tool_call>" + NL + ""
    '{"name": <function-name>, "arguments": <args-json-object>}' + NL + "</tool_call>"
    "<|im_end|>" + NL + "{%- elif sys -%}<|im_start|>system" + NL + "{{- sys -}}<|im_end|>"
    "" + NL + "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role in ('user', 'system') -%}<|im_start|>{{- m.role -}}" + NL + ""
    "{{- m.content -}}<|im_end|>" + NL + ""
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant" + NL + ""
    "{%- if m.reasoning_content -%}<think>" + NL + "{{- m.reasoning_content -}}" + NL + ""
    "</think>" + NL + NL + "{%- endif -%}{{- m.content or '' -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- if not loop.first or m.content -%}" + NL + "{%- endif -%}<tool_call>" + NL + ""
    '{"name": "{{- tc.function.name -}}", "arguments": ' + _args() + "}" + NL + "</tool_call>"
    "{%- endfor -%}<|im_end|>" + NL + ""
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|im_start|>user"
    "{%- endif -%}" + NL + "<tool_response>" + NL + "{{- m.content -}}" + NL + ""
    "</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<|im_end|>" + NL + ""
    "{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant" + NL + ""
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think>" + NL + NL + ""
    "</think>" + NL + NL + "{%- endif -%}{%- endif -%}"
)

# DeepSeek-V3 / R1-0528: tool calls between <｜tool▁calls▁begin｜> markers, each
# function<｜tool▁sep｜>NAME then the arguments in a json code block; results in
# <｜tool▁outputs▁begin｜>; R1 starts thinking in the generation prompt ("<think>\n").
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_OB, DS_OE = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
DS_O1, DS_O2 = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
DEEPSEEK = (
    "{{- bos_token -}}" + _SYSTEM_FIRST + "{{- sys or '' -}}"
    "{%- if tools -%}" + NL + NL + "## Tools" + NL + "You have access to the following tools:"
    "{%- for t in tools -%}" + NL + NL + "### {{ t.function.name -}}" + NL + "Description: "
    "{{ t.function.description or '' -}}" + NL + NL + "Parameters: "
    "{{ t.function.parameters | tojson -}}{%- endfor -%}" + NL + NL + "IMPORTANT: ALWAYS "
    "adhere to this exact format for tool use:" + NL + DS_B + DS_CB + "function" + DS_SEP + ""
    "tool_call_name" + NL + "```json" + NL + "tool_call_arguments" + NL + "```" + DS_CE + ""
    "" + DS_E + "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<｜User｜>{{- m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<｜Assistant｜>"
    "{%- endif -%}{{- m.content or '' -}}"
    "{%- if m.tool_calls -%}" + DS_B + "{%- for tc in m.tool_calls -%}"
    "{%- if not loop.first -%}" + NL + "{%- endif -%}" + DS_CB + "function" + DS_SEP + ""
    "{{- tc.function.name -}}" + NL + "```json" + NL + _args() + NL + "```" + DS_CE + ""
    "{%- endfor -%}" + DS_E + "{%- endif -%}<｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' -%}"
    "{%- if messages[loop.index0 - 1].role != 'tool' -%}" + DS_OB + "{%- endif -%}"
    "" + DS_O1 + "{{- m.content -}}" + DS_O2 + ""
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}" + DS_OE + ""
    "{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜><think>" + NL + "{%- endif -%}"
)

# GLM-4.5/4.6: [gMASK]<sop>, <|system|> <|user|> <|assistant|> <|observation|> turns; a call
# is <tool_call>NAME then <arg_key>/<arg_value> pairs (strings raw, other values as JSON);
# thinking in <think>, an empty one when it is off.
GLM45 = (
    "[gMASK]<sop>{%- if tools -%}<|system|>" + NL + "# Tools" + NL + NL + "You may call one "
    "or more functions to assist with the user query." + NL + NL + "You are provided with "
    "function signatures within <tools></tools> XML tags:" + NL + "<tools>"
    "{%- for t in tools -%}" + NL + "{{- t | tojson -}}{%- endfor -%}" + NL + "</tools>"
    "" + NL + NL + "For each function call, output the function name and arguments within the "
    "following XML format:" + NL + "<tool_call>{function-name}" + NL + ""
    "<arg_key>{arg-key-1}</arg_key>"
    "" + NL + "<arg_value>{arg-value-1}</arg_value>" + NL + "...</tool_call>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'user') -%}<|{{- m.role -}}|>" + NL + "{{- m.content -}}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>" + NL + "<think>"
    "{{- m.reasoning_content or '' -}}</think>" + NL + "{{- m.content or '' -}}"
    "{%- for tc in m.tool_calls or [] -%}" + NL + "<tool_call>{{- tc.function.name -}}"
    "{%- set a = tc.function.arguments -%}{%- if a is string -%}{%- set a = {} -%}{%- endif -%}"
    "{%- for k, v in a.items() -%}" + NL + "<arg_key>{{- k -}}</arg_key>" + NL + "<arg_value>"
    "{%- if v is string -%}{{- v -}}{%- else -%}{{- v | tojson -}}{%- endif -%}</arg_value>"
    "{%- endfor -%}" + NL + "</tool_call>{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "" + NL + "<tool_response>" + NL + "{{- m.content -}}" + NL + "</tool_response>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false -%}" + NL + "<think></think>"
    "{%- endif -%}{%- endif -%}"
)

# Llama 3.1/3.2/3.3: header turns; tools offered in the first user message as JSON, a call is
# {"name": ..., "parameters": ...} alone in the reply; results in an ipython turn.
_L = "<|start_header_id|>{{- r -}}<|end_header_id|>" + NL + NL
LLAMA3 = (
    "{{- bos_token -}}{%- set ns = namespace(done=false) -%}" + _SYSTEM_FIRST + ""
    "{%- set r = 'system' -%}" + _L + ""
    "{%- if tools -%}Environment: ipython" + NL + "{%- endif -%}Cutting Knowledge Date: "
    "December 2023" + NL + NL + "{{- sys or '' -}}<|eot_id|>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'user' -%}{%- set r = 'user' -%}" + _L + ""
    "{%- if tools and not ns.done -%}{%- set ns.done = true -%}Given the following "
    "functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt." + NL + NL + 'Respond in the format {"name": function '
    'name, "parameters": dictionary of argument name and its value}. Do not use variables.'
    "" + NL + NL + "{%- for t in tools -%}{{- t | tojson -}}" + NL + NL + "{%- endfor -%}"
    "{%- endif -%}{{- m.content -}}<|eot_id|>"
    "{%- elif m.role == 'assistant' -%}{%- set r = 'assistant' -%}" + _L + ""
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}{%- if not loop.first -%}{{- '; ' -}}"
    '{%- endif -%}{"name": "{{- tc.function.name -}}", "parameters": ' + _args() + "}"
    "{%- endfor -%}{%- else -%}{{- m.content or '' -}}{%- endif -%}<|eot_id|>"
    "{%- elif m.role in ('tool', 'ipython') -%}{%- set r = 'ipython' -%}" + _L + ""
    "{{- m.content -}}<|eot_id|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- set r = 'assistant' -%}" + _L + "{%- endif -%}"
)

# gpt-oss (harmony): <|start|>ROLE<|channel|>C<|message|>TEXT<|end|>; thinking in the analysis
# channel, the answer in final, a call in commentary addressed to=functions.NAME with
# <|constrain|>json and ended by <|call|>; results come from functions.NAME to=assistant.
GPT_OSS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI."
    "" + NL + "Knowledge cutoff: 2024-06" + NL + NL + "Reasoning: "
    "{{ reasoning_effort | default('medium') -}}" + NL + NL + "# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message."
    "{%- if tools -%}" + NL + "Calls to these tools must go to the commentary channel: "
    "'functions'.{%- endif -%}<|end|>" + _SYSTEM_FIRST + ""
    "{%- if sys or tools -%}<|start|>developer<|message|>{%- if sys -%}# Instructions"
    "" + NL + NL + "{{- sys -}}" + NL + NL + "{%- endif -%}{%- if tools -%}# Tools" + NL + NL + ""
    "## functions"
    "" + NL + NL + "namespace functions {{ '{' }}" + NL + NL + "{%- for t in tools -%}// "
    "{{ t.function.description or '' -}}" + NL + "type {{ t.function.name }} = (_: "
    "{{ t.function.parameters | tojson -}}) => any;" + NL + NL + "{%- endfor -%}"
    "} // namespace functions{%- endif -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{- m.content -}}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.reasoning_content and m.tool_calls -%}<|start|>assistant<|channel|>analysis"
    "<|message|>{{- m.reasoning_content -}}<|end|>{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}<|start|>assistant<|channel|>commentary "
    "to=functions.{{- tc.function.name }} <|constrain|>json<|message|>" + _args() + "<|call|>"
    "{%- endfor -%}{%- if m.content -%}<|start|>assistant<|channel|>final<|message|>"
    "{{- m.content -}}<|end|>{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{- m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{- m.content -}}<|end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

# Kimi-K2: tools declared in a tool_declare system turn; a call is
# <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>
# inside <|tool_calls_section_begin|>; results in a tool turn headed "## Return of ID".
KIMI = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{- tools | tojson -}}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi, "
    "an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{- m.content -}}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{{- m.content or '' -}}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}"
    "<|tool_call_begin|>{{- tc.id -}}<|tool_call_argument_begin|>" + _args() + ""
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of "
    "{{- ' ' + m.tool_call_id -}}" + NL + "{{- m.content -}}<|im_end|>"
    "{%- else -%}<|im_system|>{{- m.role -}}<|im_middle|>{{- m.content -}}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


@dataclass(frozen=True)
class ChatFormat:
    template: str
    markers: tuple[str, ...] = ()  # single tokens, as in the published tokenizer (not special)
    specials: tuple[str, ...] = ()  # single tokens the published tokenizer marks special
    eos: tuple[str, ...] = ()  # end-of-turn tokens (generation stops at them)
    bos: str | None = None


FORMATS: dict[str, ChatFormat] = {
    "qwen3": ChatFormat(
        QWEN3,
        markers=("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
                 "</tool_response>"),
        specials=("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"),
        eos=("<|im_end|>",),
    ),
    "deepseek": ChatFormat(
        DEEPSEEK,
        markers=(DS_B, DS_E, DS_CB, DS_CE, DS_SEP, DS_OB, DS_OE, DS_O1, DS_O2, "<think>",
                 "</think>"),
        specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                  "<｜Assistant｜>"),
        eos=("<｜end▁of▁sentence｜>",),
        bos="<｜begin▁of▁sentence｜>",
    ),
    "glm45": ChatFormat(
        GLM45,
        markers=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "<think>", "</think>", "<tool_response>", "</tool_response>"),
        specials=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>"),
        eos=("<|user|>", "<|observation|>"),
    ),
    "llama3": ChatFormat(
        LLAMA3,
        specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        eos=("<|eot_id|>", "<|eom_id|>"),
        bos="<|begin_of_text|>",
    ),
    "gpt_oss": ChatFormat(
        GPT_OSS,
        specials=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|call|>", "<|return|>"),
        eos=("<|return|>", "<|call|>"),
    ),
    "kimi": ChatFormat(KIMI),  # its tokens come with the tiktoken tokenizer (tiny_tiktoken.py)
}  # fmt: skip

# The chat format of each tiny family, as its published checkpoints have.
FAMILY_FORMATS = {
    "llama": "llama3",
    "qwen2": "qwen3",
    "qwen3": "qwen3",
    "qwen2-moe": "qwen3",
    "qwen3-moe": "qwen3",
    "mixtral": "qwen3",  # Mistral's [TOOL_CALLS] format is not among ours: ChatML instead
    "deepseek-v2": "deepseek",
    "deepseek-v3": "deepseek",
    "glm4-moe": "glm45",
    "kimi-k2": "kimi",
    "gpt-oss": "gpt_oss",
    # The 2026 families take the nearest format we have: Qwen3-Next is ChatML with Hermes
    # calls; Qwen3.5's XML calls and MiniMax-M2's <minimax:tool_call> are not among ours
    # (ChatML instead); V3.2's DSML calls neither (DeepSeek's format instead).
    "qwen3-next": "qwen3",
    "qwen3.5-moe": "qwen3",
    "kimi-linear": "kimi",
    "deepseek-v3.2": "deepseek",
    "minimax-m2": "qwen3",
}
