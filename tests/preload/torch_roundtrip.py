"""torch.save then torch.load of a small state dict in sys.argv[1]; prints what was loaded."""
import sys

import torch

path = sys.argv[1] + "/model_states.pt"
torch.manual_seed(0)
state = {
    "module": {"layer.weight": torch.randn(4, 3), "layer.bias": torch.arange(4.0)},
    "step": 7,
    "optimizer": {"exp_avg": torch.ones(12, dtype=torch.bfloat16)},
}
torch.save(state, path)
loaded = torch.load(path)
print(sorted(loaded.keys()), loaded["step"])
for name, tensor in loaded["module"].items():
    print(name, tuple(tensor.shape), tensor.dtype, [round(v, 6) for v in tensor.flatten().tolist()])
print("exp_avg", loaded["optimizer"]["exp_avg"].dtype, loaded["optimizer"]["exp_avg"].sum().item())
print("equal", all(torch.equal(state["module"][k], loaded["module"][k]) for k in state["module"]))
