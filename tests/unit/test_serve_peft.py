"""Our PEFT-format adapters against the peft library itself: each loads the other's files and the
outputs agree."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # loopback only: peft must not look anything up online

import torch  # noqa: E402

from unbroken.models.data import VOCAB_SIZE  # noqa: E402
from unbroken.models.gpt import build_model  # noqa: E402
from unbroken.serve.adapters import read_adapter, write_adapter  # noqa: E402
from unbroken.serve.config import base_model_id, lora_targets, serve_model  # noqa: E402
from unbroken.serve.lora import SlotTable, inject  # noqa: E402

MODEL = serve_model()
BASE = base_model_id(MODEL)


def _ours(adapter, idx):
    table = SlotTable(lora_targets(MODEL), 1, 16)
    model = inject(build_model(MODEL, VOCAB_SIZE, 0).eval(), table)
    table.put(1, adapter)
    table.use([1] * idx.shape[0])
    with torch.inference_mode():
        return model(idx)


def test_peft_saved_adapter_loads_here_and_ours_loads_in_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.set_num_threads(1)
    idx = torch.randint(0, VOCAB_SIZE, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    peft_model = get_peft_model(build_model(MODEL, VOCAB_SIZE, 0), LoraConfig(
        r=4, lora_alpha=12, target_modules=["qkv", "proj"], init_lora_weights=False)).eval()
    peft_model.peft_config["default"].base_model_name_or_path = BASE
    peft_model.save_pretrained(tmp_path / "from_peft", save_embedding_layers=False)
    with torch.inference_mode():
        want = peft_model(idx)
    got = _ours(read_adapter(tmp_path, "from_peft", model=MODEL, base=BASE, max_rank=16), idx)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want - build_model(MODEL, VOCAB_SIZE, 0).eval()(idx)).abs().max() > 1e-3  # the adapter matters

    write_adapter(tmp_path, "ours", model=MODEL, rank=8, seed=3, std=0.2)
    loaded = PeftModel.from_pretrained(build_model(MODEL, VOCAB_SIZE, 0), str(tmp_path / "ours")).eval()
    with torch.inference_mode():
        want = loaded(idx)
    got = _ours(read_adapter(tmp_path, "ours", model=MODEL, base=BASE, max_rank=16), idx)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
