"""shardkit inside the tools people train with. One module per tool, each importing that tool (install it
yourself: shardkit does not depend on any of them):

- ``shardkit.integrations.accelerate``: ``Accelerator`` and ``ShardkitPlugin`` for Hugging Face accelerate.
- ``shardkit.integrations.transformers``: ``Trainer`` and ``ShardkitTrainingArguments`` for the Hugging Face
  Trainer (built on the accelerate integration).
- ``shardkit.integrations.lightning``: ``ShardkitStrategy`` for Lightning.
- ``shardkit.integrations.torchft``: ``ProcessGroupShardkit``, torchft's reconfigurable (fault-tolerant) process group
  on shardkit's backend.

What they share, the wrapping itself (strategies, ``auto``, ZeRO optimizers, clipping, accumulation), is
``_wrapping``, which imports no training library.

These sit on top of the package (docs/design.md, "Python"): they import shardkit's fronts, nothing imports them.
"""
