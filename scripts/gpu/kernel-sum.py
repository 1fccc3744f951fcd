"""Sums an Nsight Compute CSV (--metrics gpu__time_duration.sum --csv) by kernel name, largest
first: the launches, total kernel time, and each kernel's share. Usage: kernel-sum.py CSV [TOP]"""
import collections
import csv
import sys

rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
total = collections.Counter()
count = collections.Counter()
scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
for r in rows:
    if r.get("Metric Name") == "gpu__time_duration.sum":
        value = float(r["Metric Value"].replace(",", ""))
        total[r["Kernel Name"][:80]] += value * scale.get(r.get("Metric Unit", ""), 1e-6)
        count[r["Kernel Name"][:80]] += 1
all_ms = sum(total.values())
print(f"{sum(count.values())} kernel launches, {all_ms:.2f} ms of kernel time")
for name, ms in total.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
    print(f"{ms:10.3f} ms {100 * ms / all_ms:5.1f}% {count[name]:7d}x  {name}")
