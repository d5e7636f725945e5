#!/bin/bash
# ncu of the MoE mma kernels: default tl.load scales / asm-loaded row-major scales / asm-loaded tiled scales.
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
M="l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct,launch__registers_per_thread,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__inst_executed.sum"
FMTS=mxfp4 MS=64,256 CFGS=default NCU=1 timeout 400 ncu --clock-control none -k regex:"_gate_up_mma_kernel|_down_mma_kernel" --metrics $M --csv python tmp_gpu/s12_scales.py > $OUT/ncu_moe.csv 2> $OUT/ncu_err.txt
echo "ncu rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/ncu_err.txt
python - <<'PY'
import csv, os, collections
rows = list(csv.reader(open(os.environ["OUT"] + "/ncu_moe.csv")))
hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
hdr = rows[hdr_i]; data = rows[hdr_i + 1:]
ci = {h: i for i, h in enumerate(hdr)}
per = collections.OrderedDict()
for r in data:
    key = (r[ci["ID"]], r[ci["Kernel Name"]][:22])
    per.setdefault(key, {})[r[ci["Metric Name"]]] = r[ci["Metric Value"]]
for (i, k), m in per.items():
    print(i, k)
    for name, v in m.items():
        print(f"    {name:90s} {v}")
PY
