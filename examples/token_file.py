"""Next-token training of the built-in decoder on a token file: ``--model pipec.examples.token_file:SPEC``.

A token file is a flat array of token ids and nothing else (little-endian,
``token_dtype`` each: uint16, uint32 or int32); ``python -m
pipec.examples.make_tokens INPUT.txt -o tokens.bin`` makes one from any text
file. The file is memory-mapped through the guarded reader
(``guarded_read.map_tokens``: a regular file, at most 64 GiB, a whole number
of ids, at least one window), so it is never read whole: a rank reads the
windows of the rows it needs, when it needs them.

Row i of the dataset is window i, tokens ``[i S, i S + S + 1)`` with S =
``seq_len``: its inputs are the first S tokens, its targets the S after each
(the same window shifted by one), both LongTensors; consecutive windows share
one token. The runtime orders the rows (a seeded shuffle per epoch) and stacks
``microbatch_size`` of them per microbatch (``runtime/data.py``). A token id
outside ``0 .. vocab - 1`` is a usage error naming the file, the token's
index and the vocabulary, raised when its window is read.

    python -m pipec.examples.make_tokens notes.txt -o tokens.bin
    pipec run 1f1b -D P=4 -D N=8 --model pipec.examples.token_file:SPEC --config token_file=tokens.bin
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import numpy
import torch
from torch.utils.data import Dataset

from pipec.compiler.guarded_read import TOKEN_DTYPES, map_tokens, quote, shown_path
from pipec.errors import UsageError
from pipec.runtime import model
from pipec.runtime.model import ModelConfig

# What a user runs to make a token file (quoted by the messages that want one).
MAKE_TOKENS = "python -m pipec.examples.make_tokens INPUT.txt -o tokens.bin"


@dataclass(frozen=True)
class TokenConfig(ModelConfig):
    """The built-in decoder's sizes, and the token file it trains on.

    Attributes:
        vocab: token ids the model knows (256: one per byte, what ``make_tokens`` writes).
        token_file: the token file's path (``--config token_file=PATH``); required to train.
        token_dtype: how the file stores an id: uint16, uint32 or int32.
    """

    vocab: int = 256
    token_file: str = ""
    token_dtype: str = "uint16"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_dtype not in TOKEN_DTYPES:
            raise UsageError(f"model config: token_dtype must be one of {', '.join(TOKEN_DTYPES)}, "
                             f"got {quote(self.token_dtype)}")


class TokenWindows(Dataset):
    """The windows of a token file: item i is (tokens ``[i S, i S + S)``, tokens ``[i S + 1, i S + S + 1)``).

    Args:
        path: the token file.
        dtype: its ids' dtype (a key of ``TOKEN_DTYPES``).
        seq_len: S, tokens per row.
        vocab: ids must lie in ``0 .. vocab - 1``.
    Raises:
        UsageError: the guarded reader's refusals (not a regular file, too
            large, not a whole number of ids, shorter than one window).
    """

    def __init__(self, path: str, dtype: str, seq_len: int, vocab: int):
        self.path, self.dtype, self.seq_len, self.vocab = path, dtype, seq_len, vocab
        self.tokens = map_tokens(path, dtype, seq_len + 1, needed_for=f"one window: seq_len + 1 = {seq_len + 1}")
        # window i needs tokens up to i S + S: the last one starts S + 1 before the end
        self.windows = (len(self.tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``index`` as (inputs, targets), LongTensors of ``seq_len``.

        Raises:
            IndexError: no such window.
            UsageError: a token id outside the vocabulary (its index in the file, its value, the vocabulary).
        """
        index = operator.index(index)
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} of {self.windows}")
        start = index * self.seq_len
        # a copy: the mapping is read-only, and the rows outlive this call
        window = torch.from_numpy(numpy.array(self.tokens[start:start + self.seq_len + 1], dtype=numpy.int64))
        outside = (window < 0) | (window >= self.vocab)
        if bool(outside.any()):
            at = int(outside.nonzero()[0])
            raise UsageError(f"token file '{shown_path(self.path)}': token {int(window[at])} at index "
                             f"{start + at:,} is outside the vocabulary of {self.vocab} ids (0 .. {self.vocab - 1}): "
                             f"raise --config vocab=..., or check --config token_dtype={self.dtype}")
        return window[:-1], window[1:]


def token_dataset(config: TokenConfig, seed: int) -> TokenWindows:
    """The spec's data source: the windows of ``config.token_file`` (``seed`` unused; the runtime shuffles).

    Raises:
        UsageError: no token file given, or the guarded reader's refusal of it.
    """
    if not config.token_file:
        raise UsageError(f"no token file to train on: pass --config token_file=PATH (make one from any text file "
                         f"with: {MAKE_TOKENS})")
    return TokenWindows(config.token_file, config.token_dtype, config.seq_len, config.vocab)


def describe(config: TokenConfig) -> str:
    """The built-in model's line, with this task."""
    source = f"'{config.token_file}'" if config.token_file else "a token file (--config token_file=PATH)"
    return model.describe(config, task=f"next-token prediction on {source}")


# the built-in model's spec, its synthetic task replaced by the token file
SPEC = replace(model.LLAMA, synthetic_batch=None, dataset=token_dataset, config=TokenConfig(), describe=describe)
"""The built-in decoder trained on a token file's windows (``--config token_file=PATH``)."""

__all__ = ["MAKE_TOKENS", "SPEC", "TokenConfig", "TokenWindows", "token_dataset"]
