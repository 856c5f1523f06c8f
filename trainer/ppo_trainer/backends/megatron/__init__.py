"""The megatron-core training backend: a GPTModel behind the same TrainBackend seam as TorchBackend.

`conversion` (pure torch: Hugging Face <-> megatron names, QKV and gated-MLP packing, tensor-
parallel shards) and `config` (a Hugging Face config -> megatron's TransformerConfig and GPTModel
arguments) import no megatron and run on any machine; `backend` imports megatron-core, which
needs a CUDA device. Importing this package imports nothing heavy.
"""
