"""Small models for real vLLM runs (tests and benchmarks), built on the spot: nothing is
downloaded. Needs ``transformers`` and ``tokenizers`` (vLLM's own dependencies).

:func:`build_model` writes a Llama-style model with random weights (``transformers``'
``LlamaForCausalLM``, seeded) and a word-level tokenizer whose vocabulary is ``w0 .. wN`` to a
directory vLLM loads with ``HF_HUB_OFFLINE=1``. Two models built with different ``seed`` have the
same shapes and different weights; ``layers``, ``dtype`` or ``sliding_window`` change the KV
cache itself. :func:`prompt` makes a prompt of exactly ``n`` tokens (one token per word).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512
SPECIAL = ("<unk>", "<s>", "</s>")


def build_model(path: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                dtype: str = "float32", seed: int = 0, sliding_window: int | None = None,
                max_len: int = 4096) -> Path:
    """A random-weight Llama-style model at ``path`` (returned). With ``sliding_window``, every
    other layer attends to a window of that many tokens (``layer_types``: a hybrid model whose
    KV cache has a sliding-window group and a full-attention group)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": len(SPECIAL) + i for i in range(VOCAB - len(SPECIAL))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    extra: dict[str, Any] = {}
    if sliding_window is not None:
        extra = {"sliding_window": sliding_window,
                 "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype=dtype, **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def prompt(n: int, seed: int = 0, prefix: list[int] | None = None) -> list[int]:
    """``n`` token ids (words ``w..``, no special tokens); the first ones are ``prefix``."""
    import random

    rng = random.Random(seed)
    head = list(prefix or [])[:n]
    return head + [len(SPECIAL) + rng.randrange(VOCAB - len(SPECIAL)) for _ in range(n - len(head))]
