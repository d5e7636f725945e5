"""CPU reproduction (fifteenth session): the decompositions inductor applies on GPUs under coordinate_descent_tuning
(torch/_inductor/decomposition.py: bmm / mm with a unit dimension -> mul + sum), forced on CPU; which dsv4 sites match?
Run: TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python cpu_cdt_decompositions.py {cdt,base}"""
import sys
import torch
import torch._inductor.decomposition as decomp
import dsv4_compile
from dsv4_compile.model.fp4_experts import quantize_experts_
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model

aten = torch.ops.aten
if sys.argv[1] == "cdt":
    def bmm(self, batch2, out_dtype=None):
        if self.shape[1] == 1 or batch2.shape[2] == 1:
            return (self.unsqueeze(-1) * batch2.unsqueeze(1)).sum(dim=2)
        return NotImplemented

    def mm(self, input2, out_dtype=None):
        if self.shape[0] == 1 or input2.shape[1] == 1:
            return (self.unsqueeze(2) * input2.unsqueeze(0)).sum(dim=1)
        return NotImplemented
    decomp.decompositions[aten.bmm.default] = bmm
    decomp.decompositions[aten.mm.default] = mm

model = tiny_model(seed=2, **FAST_COMPILE_OVERRIDES)
quantize_experts_(model, "mxfp4")
engine = dsv4_compile.optimize(model, max_batch=2, max_context=256)
ids = torch.tensor([[3], [5]]); start = torch.tensor([4, 7]); rows = torch.tensor([0, 1])
engine.step(ids, start, rows)
for r in engine.site_status():
    print(r.pass_name, r.layer, r.matched, (r.reason or "")[:100])
