"""Unprofiled warm TTFT (conduit r=0.1 and full prefill) of the conduit_rt on PYTHONPATH: medians."""
import json, sys, time, torch
import conduit_rt
from conduit_rt.bench.config import E2ESizes
from conduit_rt.bench.e2e import EndToEnd
from conduit_rt.bench.timing import Timer
label, repeats = sys.argv[1], int(sys.argv[2])
e2e = EndToEnd(E2ESizes(), Timer(torch.device("cuda")), torch.bfloat16)
e2e.request("first", e2e.first, refresh="conduit", max_tokens=1)
for _ in range(2):
    e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
    e2e.request("second", e2e.second, max_tokens=1)
out = {"label": label, "package": conduit_rt.__file__}
for name, kw in (("conduit", {"refresh": "conduit", "refresh_budget": 0.1}), ("full", {}),
                 ("conduit2", {"refresh": "conduit", "refresh_budget": 0.1})):
    r = e2e.ttft(name, e2e.second, repeats, **kw)
    out[name] = round(r["ttft_s"] * 1e3, 2); out[name + "_samples"] = [round(x * 1e3, 2) for x in r["samples_s"]]
out["ratio"] = round(out["full"] / min(out["conduit"], out["conduit2"]), 3)
print(json.dumps(out))
