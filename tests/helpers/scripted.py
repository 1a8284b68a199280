"""A tiny target whose replies are known in advance, with tool calls and think blocks.

The model: one-hot embeddings (hidden size = vocabulary), attention and MLP
blocks that add nothing (zero output projections), and a head that maps
each token to a fixed successor (the EOS for tokens without one). A prompt
ending in token t gets the reply succ(t), succ(succ(t)), ... exactly, and
the logit gap (~10 sqrt(H)) keeps sampling on the script too.

The tokenizer: the tiny BPE plus one added token per scripted piece, and a
ChatML template that renders tools, assistant tool calls and tool results
like Qwen's; mlx-lm infers from it the json_tools parser (``<tool_call>`` ...
``</tool_call>``) and the think markers (``<think>`` / ``</think>``). The
generation prompt picks the script: ``<|assistant|>`` after a user turn,
``<|after_tool|>`` after a tool result, ``<|broken|>`` with the template
argument ``mode="broken"``; ``enable_thinking=false`` closes an empty think
block in the prompt (the reply then starts after ``</think>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .tokenizer import EOS_ID, EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, MASK_TOKEN, _train_tokenizer, write_json

REASONING = "The user asks for the weather in Paris, so I call the tool."
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
ANSWER = "It is 18 degrees and sunny in Paris."
BROKEN_OPEN, BROKEN_CLOSE = "<tool_call>{this is not json", " at all}</tool_call>"

SCRIPTS = {  # trigger -> the reply's pieces (each one token), then the EOS
    "<|assistant|>": ["<think>", REASONING, "</think>", "<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>"],
    "<|after_tool|>": [ANSWER],
    "<|broken|>": ["Let me try. ", BROKEN_OPEN, BROKEN_CLOSE],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}

TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    '{%- endfor %}{{ \'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}{%- set tool_call = tc.function %}"
    '{{ \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' + (tool_call.arguments | tojson) }}'
    "{{ '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if mode is defined and mode == 'broken' %}{{ '<|broken|>' }}"
    "{%- elif messages[-1].role == 'tool' %}{{ '<|after_tool|>' }}{%- else %}{{ '<|assistant|>' }}{%- endif %}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{%- endif %}"
    "{%- endif %}"
)


def _pieces() -> list[str]:
    seen = []
    for trigger, reply in SCRIPTS.items():
        for piece in [trigger, *reply]:
            if piece not in seen:
                seen.append(piece)
    return seen


def make_scripted_target(out_dir: Path, context: int = 4096) -> Path:
    """Write the scripted qwen3 target (float32) and its tokenizer to `out_dir`, with a context of
    `context` tokens."""
    from mlx_lm.utils import _get_classes, save_config
    from mlx.utils import tree_flatten
    from tokenizers import AddedToken

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in _pieces()])
    vocab = tok.get_vocab_size()
    hidden = -(-vocab // 32) * 32
    tok.save(str(out_dir / "tokenizer.json"))
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "mask_token": MASK_TOKEN,
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
            "chat_template": TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": context,
        },
    )

    config = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": hidden,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    successor = np.full(hidden, EOS_ID)
    for trigger, reply in SCRIPTS.items():
        chain = [tok.token_to_id(p) for p in [trigger, *reply]]
        for a, b in zip(chain, chain[1:]):
            if successor[a] not in (EOS_ID, b):
                raise ValueError(f"token {a} has two successors in the scripts")
            successor[a] = b
    rng = np.random.default_rng(0)
    weights = {}
    for name, param in tree_flatten(model.parameters()):
        if name.endswith("embed_tokens.weight"):
            w = np.eye(hidden, dtype=np.float32)
        elif name.endswith("lm_head.weight"):
            w = np.zeros((hidden, hidden), np.float32)
            w[successor, np.arange(hidden)] = 10.0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = np.zeros(param.shape, np.float32)  # the blocks add nothing to the residual stream
        elif name.endswith("norm.weight"):
            w = np.ones(param.shape, np.float32)
        else:
            w = rng.normal(0, 0.05, param.shape).astype(np.float32)
        weights[name] = mx.array(w)
    model.load_weights(list(weights.items()), strict=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    save_config(config, out_dir / "config.json")
    return out_dir
