#!/usr/bin/env bash
# First look at issue 13: drafter on core 0, verifier on core 1 (one thread each), real pair, fp32 target,
# int8 drafter, rsd_s 3x4 through the real services with and without pre-drafting; the target alone on one
# core and on both. One prompt, 48 tokens: an indication, not the deciding benchmark (§6).
cd "$(dirname "$0")/.."  # the repository root
P=$'# Return the n-th Fibonacci number\ndef fibonacci(n):'
grep -o 'avx512_bf16\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; uptime
for pd in on off; do
  for T in 0 1; do
    echo "== predraft $pd T=$T"
    .venv/bin/rsd cluster --drafter-cores 0 --verifier-cores 1 --threads 1 --draft-quantize int8 --predraft $pd \
      --max-new-tokens 48 --temperature $T --prompt "$P" 2>&1 | grep -E "^\[rsd_s|up in"
  done
done
for T in 0 1; do
echo "== ar one core T=$T"; .venv/bin/rsd generate --method ar --cores 1 --threads 1 --max-new-tokens 48 --temperature $T --prompt "$P" 2>&1 | grep "^\[ar"
echo "== ar two cores T=$T"; .venv/bin/rsd generate --method ar --cores 0-1 --threads 2 --max-new-tokens 48 --temperature $T --prompt "$P" 2>&1 | grep "^\[ar"
done
uptime
