"""Trainer ranks: the Ray actor (`actor`), Megatron-core (`megatron_engine`), the reference trainer
(`reference`), the GRPO loss with its off-policy corrections (`grpo`), and the re-scoring of a sample
whose tokens came from several weight versions (`behaviour`)."""
