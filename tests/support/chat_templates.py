"""A minimal chat template in the Qwen3 style, written for the tests: ChatML turns, earlier
assistant turns rendered without their reasoning, and an `enable_thinking` switch: False writes
an empty think block (the reply is all answer), True opens the think block in the prompt (the
reply starts inside it, as templates that force reasoning do), unset leaves it to the model."""

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
    "{%- elif enable_thinking is defined -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
