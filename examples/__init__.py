"""Worked examples of pipec's runtime interfaces, installed as ``pipec.examples``.

``token_file``: next-token training of the built-in decoder on a token file
(a flat, memory-mapped array of token ids), a model spec whose data source is
a ``torch.utils.data.Dataset``. ``make_tokens``: the script that makes such a
file from any text file (byte-level tokens). See docs/runtime.md, "Training
on your own text".
"""
