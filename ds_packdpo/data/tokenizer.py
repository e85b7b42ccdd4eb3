"""Tokenizers: a local BPE built here, or one loaded from a folder or a hub id.

The embedded default run and the tests need a real HF tokenizer with a chat
template but may not download one, so :func:`train_bpe_tokenizer` trains a small
byte-level BPE with the ``tokenizers`` library and wraps it as a
``PreTrainedTokenizerFast``.  Its template puts a special token around every
turn, so a rendered prompt is always a token-exact prefix of the rendered
prompt + reply (the property the data stage relies on to split them).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ..errors import InputError, first_line
from ..hub import hub_load_error, is_hub_id

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, EOS, PAD] + [f"<|{role}|>" for role in ROLES]

# Every turn is <|role|>content<|eos|>; the sequence starts with <|bos|> and the
# generation prompt is the assistant header.  Roles outside ROLES are refused.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``; deterministic for the same texts in the same order."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(texts, trainer=trainer)
    # Plain tokenizer calls start with BOS like the chat template does, so standard
    # (string) and conversational data give sequences of the same shape.
    model.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, model.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    """``AutoTokenizer`` from a local folder, or from a hub id (at ``revision``) through the hub cache; a missing
    or unreadable one is an InputError."""
    if is_hub_id(path):
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
        except OSError as exc:
            raise hub_load_error("tokenizer", path, exc) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"tokenizer {path}: cannot load it ({first_line(exc)})") from None
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"tokenizer {path}: no such folder")
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise InputError(f"tokenizer {path}: cannot load it ({reason})") from None


def pad_token_id(tokenizer) -> int:
    """The id that fills padding and dummy rows: the tokenizer's pad token, else its EOS, else 0.

    The one rule for every command.  The value never reaches a loss (padding carries
    label -100 and a padded batch masks it), but every rank must use the same one.
    """
    return next(token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if token is not None)
