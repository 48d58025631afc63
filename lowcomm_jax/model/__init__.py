"""The model: nanoGPT-compatible GPT and the Llama family, MatFormer nested FFN, named presets
(pretrained importers: model/pretrained.py; LoRA adapters: model/lora.py)."""

from lowcomm_jax.model.generate import generate
from lowcomm_jax.model.gpt import GPT, count_params, next_token_loss
from lowcomm_jax.model.matformer import NestedMLP, hidden_units
from lowcomm_jax.model.presets import PRESETS, GPTConfig, get_preset
