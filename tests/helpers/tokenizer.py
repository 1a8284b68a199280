"""The tiny tokenizer: special tokens and their ids, the BPE corpus, the chat template.

``make_tokenizer`` writes a byte-level BPE (``tokenizers``) of exactly
``TINY_VOCAB`` entries with a ChatML template; it loads with ``AutoTokenizer``
and ``mlx_lm.load``. Every tiny target directory carries these files.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_VOCAB = 512

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
BOS_TOKEN = "<s>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN, BOS_TOKEN)

# Special tokens take the first ids, in the order above. ``<s>`` is in every
# vocabulary (so ids never shift), but it is only declared as BOS and prepended
# by the post-processor when ``make_tokenizer(..., add_bos=True)``.
EOS_ID, IM_START_ID, IM_END_ID, MASK_ID, BOS_ID = range(len(SPECIAL_TOKENS))
PAD_ID = EOS_ID

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text for the BPE merges (original prose; do not edit, the
# token ids of every tiny model depend on it).
_CORPUS = """\
The river ran past the old mill and under the stone bridge near the market.
Every morning the baker opened the shop at six and sold warm bread to the town.
A small robot named Pico liked to count things: one, two, three, four, five.
It counted the birds on the roof, the cars on the road and the stars at night.
When the rain came, the children played inside and built towers out of boxes.
Their teacher asked them to write a short story about a journey to the sea.
Some of them wrote about ships, others about trains, and one about a flying fish.
The weather today is cold and windy, but tomorrow it should be sunny and warm.
Please remember to bring your notebook, a pencil and a bottle of water.
In the garden there are apples, pears, plums and a row of bright yellow flowers.
The library is open from nine in the morning until eight in the evening.
Numbers such as 12, 345 and 6789 appear in tables, lists and simple programs.
def add(a, b): return a + b  # a tiny function that adds two numbers
for i in range(10): print(i * i)
Question: what is the capital of the country? Answer: the city by the river.
She said that the meeting would start at ten and finish before lunch time.
He walked to the station, bought a ticket and waited for the next train home.
Good models predict the next word; better models also explain their answers.
The cat sat on the warm window and watched the people walking in the street.
We measured the length, the width and the height of each box in centimeters.
"""

# ---------------------------------------------------------------- tokenizer


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != TINY_VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} entries")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def make_tokenizer(out_dir: Path, *, add_bos: bool = False) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json.

    ``add_bos=True`` declares ``<s>`` (id ``BOS_ID``) as BOS, prepends it when
    encoding with special tokens, and starts the chat template with it.
    """
    from tokenizers import processors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A" if add_bos else "$A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B" if add_bos else "$A $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    tok.save(str(out_dir / "tokenizer.json"))

    specials = dict(
        bos_token=BOS_TOKEN if add_bos else None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        mask_token=MASK_TOKEN,
    )
    config = dict(
        specials,
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=add_bos,
        add_eos_token=False,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=("{{ bos_token }}" if add_bos else "") + CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    smap = {k: v for k, v in specials.items() if v is not None}
    smap["additional_special_tokens"] = [IM_START_TOKEN, IM_END_TOKEN]
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(out_dir / "special_tokens_map.json", smap)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
