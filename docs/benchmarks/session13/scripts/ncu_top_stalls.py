"""Top warp-stall samples by SASS instruction from `ncu --page source --csv --print-source sass`
(call 35): python3 ncu_top_stalls.py ncu_source_prod.csv [n]."""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
header, data = rows[1], rows[2:]
col = {name: header.index(name) for name in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")}
samples = [int(r[col["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
total = sum(samples)
print(f"{total} samples, {sum(int(r[col['Instructions Executed']] or 0) for r in data)} warp instructions executed")
for i in sorted(range(len(data)), key=lambda i: -samples[i])[: int(sys.argv[2]) if len(sys.argv) > 2 else 20]:
    r = data[i]
    print(f"{i:5d} {100 * samples[i] / total:5.1f}% {r[col['Instructions Executed']]:>9} {r[col['Source']].strip()[:80]}")
