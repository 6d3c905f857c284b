"""A teacher saved in bfloat16 (its config.json says ``"dtype": "bfloat16"``, as most Hugging Face checkpoints
do) still gets float32 student blocks and a float32 assembled student: models built from the teacher's config
follow the config's dtype in transformers 5 unless told otherwise, and a bfloat16 block fed float32 boundaries
fails in its first matmul."""
import torch

from zgcore.models.adapters import StudentBlock
from zgcore.models.teacher import tiny_config


def test_a_bfloat16_teacher_config_builds_a_float32_block_that_runs_on_float32_boundaries():
    cfg = tiny_config("llama", n_layers=4)
    cfg.dtype = torch.bfloat16
    block = StudentBlock(cfg, [0, 1])
    assert {p.dtype for p in block.parameters()} == {torch.float32}
    x = torch.randn(2, 5, cfg.hidden_size)
    y = block(x)
    assert y.dtype == torch.float32 and y.shape == x.shape and torch.isfinite(y).all()
