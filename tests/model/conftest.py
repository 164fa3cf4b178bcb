from __future__ import annotations

import pytest
import torch

from tests.model.helpers import make_checkpoint
from workers.model.loader import load_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_nomtp_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_nomtp") / "ckpt", seed=3, mtp=False)


@pytest.fixture(scope="session")
def model(tiny_dir):
    torch.manual_seed(0)
    return load_model(tiny_dir, kernels="torch")


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
