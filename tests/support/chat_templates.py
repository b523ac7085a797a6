"""A minimal chat template in the Qwen3 style, written for the tests: ChatML turns, earlier
assistant turns rendered without their reasoning, an `enable_thinking` switch (False writes an
empty think block, so the reply is all answer) and a `think_in_prompt` switch (the prompt opens
the think block, so the reply starts inside it, as some reasoning templates do)."""

THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set text = m.content -%}"
    "{%- if m.role == 'assistant' and '</think>' in text -%}"
    "{%- set text = text.split('</think>')[-1].lstrip() -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- elif think_in_prompt is defined and think_in_prompt -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
