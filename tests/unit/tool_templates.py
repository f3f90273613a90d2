"""Chat templates that render tools, one per tool-call family, written from each family's published format (the
parts that carry tools and calls; the rest of each published template is left out). Each takes OpenAI's ``tools``
and assistant ``tool_calls`` with ``arguments`` an object, as Hugging Face templates do."""

from __future__ import annotations

_CHATML_TURNS = (
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.function.name + \'", "arguments": \' }}'
    "{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _CHATML_TURNS
)

QWEN3_CODER = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n<function>\\n<name>' + tool.function.name + '</name>\\n<parameters>' }}"
    "{{- tool.function.parameters | tojson }}{{- '</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format:\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.function.name + '>\\n' }}"
    "{%- for name, value in tool_call.function.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' }}"
    "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _CHATML_TURNS
)

PYTHONIC = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call functions, in the format "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. "
    "The functions:\\n' }}{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' }}"
    "{%- for tool_call in message.tool_calls %}{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- tool_call.function.name + '(' }}"
    "{%- for name, value in tool_call.function.arguments | items %}{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- name + '=' }}{{- value | tojson }}{%- endfor %}{{- ')' }}"
    "{%- endfor %}{{- ']<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n"
    'Answer with <|python_tag|> and function calls as JSON {"name": function name, "parameters": an object}, '
    "separated by ;\\n' }}{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}"
    "{%- for tool_call in message.tool_calls %}{%- if not loop.first %}{{- ';' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.function.name + \'", "parameters": \' }}'
    "{{- tool_call.function.arguments | tojson }}{{- '}' }}{%- endfor %}{{- '<|eom_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL = (
    "{{- '<s>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last or tools and loop.index0 == 0 %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.function.name + \'", "arguments": \' }}'
    "{{- tool_call.function.arguments | tojson }}{{- '}' }}{%- endfor %}{{- ']</s>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | tojson + '}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- message.content + '</s>' }}{%- endif %}"
    "{%- endfor %}"
)

DEEPSEEKV3 = (
    "{{- '<｜begin▁of▁sentence｜>' }}"
    "{%- if tools %}{{- '## Tools\\nYou have access to the following tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<｜Assistant｜>' + message.content + '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool_call in message.tool_calls %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tool_call.function.name + '\\n```json\\n' }}"
    "{{- tool_call.function.arguments | tojson }}{{- '\\n```<｜tool▁call▁end｜>' }}{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message.content }}"
    "{{- '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

KIMI_K2 = (
    "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' + message.content + '<|tool_calls_section_begin|>' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '<|tool_call_begin|>functions.' + tool_call.function.name + ':' + loop.index0 | string }}"
    "{{- '<|tool_call_argument_begin|>' }}{{- tool_call.function.arguments | tojson }}{{- '<|tool_call_end|>' }}"
    "{%- endfor %}{{- '<|tool_calls_section_end|><|im_end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + message.tool_call_id + '\\n' + message.content }}"
    "{{- '<|im_end|>' }}"
    "{%- else %}{{- '<|im_' + message.role + '|>' + message.role + '<|im_middle|>' + message.content }}"
    "{{- '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)

GPT_OSS = (
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}{{- '\\n// ' + (tool.function.description or '') + '\\ntype ' }}"
    "{{- tool.function.name + ' = (_: ' + tool.function.parameters | tojson + ') => any;\\n' }}{%- endfor %}"
    "{{- '\\n} // namespace functions<|end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.function.name }}"
    "{{- ' <|constrain|>json<|message|>' }}{{- tool_call.function.arguments | tojson }}{{- '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.result to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

TEMPLATES = {
    "qwen25": QWEN25,
    "qwen3_coder": QWEN3_CODER,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "deepseekv3": DEEPSEEKV3,
    "kimi_k2": KIMI_K2,
    "pythonic": PYTHONIC,
    "gpt-oss": GPT_OSS,
}
"""Each family's template by its ``--tool-call-parser`` name (Hermes is the default of templates with no syntax)."""
