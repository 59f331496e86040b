"""Running compiled schedules: each torchrun worker walks its rank's instruction list over torch.distributed.

``model``: the built-in LLaMA-style decoder cut into chunks, its synthetic task,
and the model-spec interface a user's own model plugs into (``--model``).
``data``: where every training path draws a step's rows from (the spec's data
source), which ranks read what, and the data position a checkpoint saves.
``reference``: the same training on one process, the oracle of exactness.
``interpreter``: the per-rank loop; ``worker`` and ``__main__``: the process a
torchrun worker runs. See docs/runtime.md.
"""
