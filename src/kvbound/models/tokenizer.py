"""Tokenizer: a `tokenizers.Tokenizer` plus the chat template and stop tokens.

GGUF files carry the vocabulary, merges and special tokens as metadata; `from_gguf_fields` rebuilds
the byte-level BPE tokenizer from them. HF directories ship a tokenizer.json that loads as is.
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from ..errors import KvboundError

# Pre-tokenizer split patterns named by GGUF's `tokenizer.ggml.pre` (llama.cpp's names).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    def split(pattern):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm",):  # digits one by one, then GPT-2 splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split(_GPT2_SPLIT), byte_level])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([split(_LLAMA3_SPLIT), byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([split(_QWEN2_SPLIT), byte_level])
    if pre in ("gpt2", "default", ""):
        return pre_tokenizers.Sequence([split(_GPT2_SPLIT), byte_level])
    raise KvboundError(f"GGUF tokenizer: unsupported pre-tokenizer {pre!r} "
                       "(supported: gpt2, smollm, llama-bpe, qwen2)")


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_ids: list[int], add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_ids = sorted(set(i for i in eos_ids if i is not None))
        self.add_bos = add_bos
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None

    def meta(self) -> dict:
        """Constructor arguments besides the `tokenizers.Tokenizer` (to save alongside tokenizer.json)."""
        return dict(chat_template=self.chat_template, bos_token=self.bos_token, eos_token=self.eos_token,
                    eos_ids=self.eos_ids, add_bos=self.add_bos)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise KvboundError("--chat: this model has no chat template")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise KvboundError(f"a chat message is a dict with 'role' and 'content' strings, got {str(m)[:80]!r}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)

        def raise_exception(msg):
            raise KvboundError(f"chat template: {msg}")
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, raise_exception=raise_exception,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise KvboundError(f"GGUF tokenizer: unsupported tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
        tokens = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
        tok.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
        tok.add_special_tokens(special)
        tok.add_tokens(user)

        def tok_at(key):
            i = meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None
        eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        return cls(tok, meta.get("tokenizer.chat_template"), tok_at("tokenizer.ggml.bos_token_id"),
                   tok_at("tokenizer.ggml.eos_token_id"), eos_ids,
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: Path, eos_ids: list[int]) -> "Tokenizer":
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise KvboundError(f"{path}: missing tokenizer.json")
        tok = HFTokenizer.from_file(str(tj))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def as_str(t):
            return t.get("content") if isinstance(t, dict) else t
        bos, eos = as_str(cfg.get("bos_token")), as_str(cfg.get("eos_token"))
        ids = list(eos_ids) + ([tok.token_to_id(eos)] if eos else [])
        return cls(tok, template, bos, eos, ids, add_bos=bool(cfg.get("add_bos_token", False)))


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Each push decodes a short window, not the whole list (vLLM's incremental detokenization): the tokens
    from `prefix` on, against the same window without the new tokens, so that a decoder which treats a
    leading token specially (a stripped leading space) does so on both sides of the difference."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens already turned into text

    def push(self, *token_ids: int) -> str:
        """The text that the new token(s) complete ("" while a character is still incomplete)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        text = decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
