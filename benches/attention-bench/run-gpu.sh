#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md in one run, on a machine with an NVIDIA GPU, its Vulkan driver
# and PyTorch with CUDA: ours (`--impl fused`, the GPU kernel), our layer on Burn's attention op
# (`--impl burn-op`) and PyTorch's SDPA, interleaved shape by shape, every row timed with 20 calls
# per sync. Rows in order of what the targets need; once DEADLINE seconds have passed the rest are
# skipped (saying so), so that one run fits the device's minutes. Then gpu_targets.py prints
# met/missed per target.
#   benches/attention-bench/run-gpu.sh OUT.jsonl [DEADLINE_S]
# On the device machine (see benches/attention-bench/prepare-gpu.sh, which makes .gpu/ and .gl/):
#   for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; xz -dk .gpu/*.xz; chmod +x .gpu/*;
#   BIN_DIR=.gpu benches/attention-bench/run-gpu.sh $OUT/gpu.jsonl 420
# A dry run without a GPU (lavapipe, PyTorch on the CPU, small shapes, a 1-layer model; lavapipe
# cannot hold GPT-2's f32 embedding in one buffer):
#   PEER_DEVICE=cpu CORE_SEQS="64 128" LAYER_SHAPES=1x64x768x12 DECODE_SHAPES=1x64x768x12 \
#     LONG=128 CALLS=2 MODEL_FAMILIES=smollm2 MODEL_LAYERS=1 MODEL_PROMPT=8 MODEL_NEW=3 \
#     PACKED_SHAPE=1x128x768x12 PACKED_DOCUMENTS=16,40,8,64 \
#     PAGED_SHAPE=4x128x768x12 PAGED_LENGTHS=32,128,2,64 WORKLOAD_FAMILIES=smollm2 \
#     WORKLOAD_FILE=/tmp/w4.jsonl WORKLOAD_KV_MIB=64 benches/attention-bench/run-gpu.sh /tmp/gpu.jsonl
# (/tmp/w4.jsonl: the first 4 lines of benches/lm-bench/workloads/a-mixed.jsonl)
set -uo pipefail
out=$1
deadline=$(($(date +%s) + ${2:-420}))
here=$(cd "$(dirname "$0")" && pwd)
bin=${BIN_DIR:-$here/../../target/release}
py=${TORCH_PYTHON:-python3}
device=${PEER_DEVICE:-cuda}
rounds=${ROUNDS:-2}
calls=${CALLS:-20}
core_seqs=${CORE_SEQS:-1024 2048 4096 8192}
layer_shapes=${LAYER_SHAPES:-4x512x768x12 1x1024x768x12 1x2048x768x12 1x4096x768x12 1x8192x768x12}
decode_shapes=${DECODE_SHAPES:-1x1024x768x12 8x1024x768x12 1x16384x768x12}
long=${LONG:-8192}
# The packed row: the 16 documents of documents-4096x16.txt, which other scripts read too.
packed_shape=${PACKED_SHAPE:-1x4096x768x12}
packed_documents=${PACKED_DOCUMENTS:-$(grep -v '^#' "$here/documents-4096x16.txt" | tr -d ' \n')}
# The paged decoding step: 8 rows at their own lengths, the longest the shape's.
paged_shape=${PAGED_SHAPE:-8x4096x768x12}
paged_lengths=${PAGED_LENGTHS:-32,64,128,256,512,1024,2048,4096}
model_families=${MODEL_FAMILIES:-gpt2 smollm2}
model_prompt=${MODEL_PROMPT:-128}
model_new=${MODEL_NEW:-64}
# Empty: the families' whole depth; a number cuts every model to that many layers (dry runs).
model_layers=${MODEL_LAYERS:-}
: > "$out"

# Whether time is left; says what is skipped when not.
left() {
  [ "$(date +%s)" -lt "$deadline" ] && return 0
  echo "{\"skipped\":\"$1\",\"reason\":\"deadline\"}" >> "$out"
  return 1
}
# One line per shape into OUT, tagged with the round (and with TAG's fields, e.g.
# `"model":"gpt2",`); a crash or timeout is a line too.
record() {
  local round=$1
  shift
  local lines
  lines=$(timeout 150 "$@" 2>/tmp/run-gpu.err)
  local rc=$?
  if [ -n "$lines" ]; then
    echo "$lines" | sed "s/^{/{\"round\":$round,${TAG:-}/" >> "$out"
  fi
  if [ $rc -ne 0 ]; then
    local why
    why=$(tail -c 300 /tmp/run-gpu.err | tr '"\n\\' "' /")
    echo "{\"round\":$round,\"failed\":\"$*\",\"rc\":$rc,\"stderr\":\"$why\"}" >> "$out"
  fi
  return $rc
}
ours() { record "$1" "$bin/attention-bench" --backend wgpu --repeats 5 --warmup 2 \
  --calls-per-sync "$calls" "${@:2}"; }
torch() { record "$1" "$py" "$here/peer_cuda.py" --device "$device" --repeats 5 --warmup 2 \
  --calls-per-sync "$calls" "${@:2}"; }

lscpu | grep -m1 "Model name" | sed 's/.*: *//; s/^/{"kind":"machine","cpu":"/; s/$/"}/' >> "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null |
  sed 's/^/{"kind":"gpu","gpu":"/; s/$/"}/' >> "$out"

# 1. The core, f32: ours, Burn's op, SDPA.
for round in $(seq "$rounds"); do
  for mode in fwd fwdbwd; do
    for seq in $core_seqs; do
      left "core $mode $seq round $round" || break 3
      shape=1x${seq}x768x12
      ours "$round" --impl fused --core --mode $mode --shape "$shape"
      ours "$round" --impl burn-op --core --mode $mode --shape "$shape"
      torch "$round" --core --mode $mode --shapes "$shape"
    done
  done
done
# 2. The layer, f32.
for mode in fwd fwdbwd; do
  for shape in $layer_shapes; do
    left "layer $mode $shape" || break 2
    ours 1 --impl fused --mode $mode --shape "$shape"
    ours 1 --impl burn-op --mode $mode --shape "$shape"
    torch 1 --mode $mode --shapes "$shape"
  done
done
# 3. Decoding one token: the layer over its cache.
for shape in $decode_shapes; do
  left "decode $shape" || break
  ours 1 --impl fused --mode decode --shape "$shape"
  ours 1 --impl burn-op --mode decode --shape "$shape"
  torch 1 --mode decode --shapes "$shape"
done
# 4. Grouped heads (3 key/value heads of 12) and a 512-key window beside all heads, the core.
for mode in fwd fwdbwd; do
  left "grouped and window $mode" || break
  shape=1x${long}x768x12
  ours 1 --impl fused --core --mode $mode --shape "$shape"
  ours 1 --impl fused --core --mode $mode --shape "$shape" --num-kv-heads 3
  ours 1 --impl fused --core --mode $mode --shape "$shape" --sliding-window 512
  torch 1 --core --mode $mode --shapes "$shape" --num-kv-heads 3
done
# 5. Packed documents, forward and backward, the core and the layer: the row packed from its 16
# documents beside the same row as one document, in the same round. Tagged `packed_set`, so that
# gpu_targets.py compares them with each other and not with the rows above.
for round in $(seq "$rounds"); do
  for core in --core ""; do
    left "documents fwdbwd ${core:-layer} round $round" || break 2
    TAG="\"packed_set\":\"$packed_shape\"," ours "$round" --impl fused $core --mode fwdbwd \
      --shape "$packed_shape" --documents "$packed_documents"
    TAG="\"packed_set\":\"$packed_shape\"," ours "$round" --impl fused $core --mode fwdbwd \
      --shape "$packed_shape"
  done
done
# 6. A decoding step of rows at their own lengths over a page pool (the GPU kernel reading every
# sequence's pages in place, one launch a step), beside the same rows padded in a dense cache,
# and equal lengths, paged beside dense. Tagged `paged_set`.
for round in $(seq "$rounds"); do
  left "paged decode round $round" || break
  for cache in paged dense; do
    TAG="\"paged_set\":\"ragged\"," ours "$round" --impl fused --mode decode \
      --shape "$paged_shape" --cache "$cache" --lengths "$paged_lengths"
  done
  for shape in $decode_shapes; do
    for cache in paged dense; do
      TAG="\"paged_set\":\"equal\"," ours "$round" --impl fused --mode decode \
        --shape "$shape" --cache "$cache"
    done
  done
done
# 7. Keys and values in fewer bytes (the int8/f16 caches issue): a decoding step over a cache
# stored in f32, f16 and int8 (the GPU kernel unpacking them in its tile load), dense and paged,
# at the decoding shapes. Tagged `kv_set`; the whole models decode over int8 in section 8.
for round in $(seq "$rounds"); do
  left "kv dtypes round $round" || break
  for shape in $decode_shapes; do
    for cache in dense paged; do
      for kv_dtype in f32 f16 int8; do
        TAG="\"kv_set\":\"$cache\"," ours "$round" --impl fused --mode decode \
          --shape "$shape" --cache "$cache" --kv-dtype "$kv_dtype"
      done
    done
  done
done
# 8. Whole models (the whole-models issue): random-weight checkpoints saved here by transformers,
# decoded by lm-bench on wgpu in f32 and f16 and by transformers' generate on the GPU in float32
# and bfloat16, greedy, batch 1 and 8; and ours in f32 over an int8 cache.
models=$(mktemp -d)
for family in $model_families; do
  left "model $family" || break
  dir="$models/$family"
  record 1 "$py" "$here/peer_lm.py" --family "$family" ${model_layers:+--layers "$model_layers"} \
    --save "$dir" || continue
  for dtype in f32 f16; do
    TAG="\"model\":\"$family\"," record 1 "$bin/lm-bench" --model "$dir" --backend wgpu \
      --dtype $dtype --batch 1 --batch 8 --prompt "$model_prompt" --new "$model_new" --repeats 2
  done
  TAG="\"model\":\"$family\"," record 1 "$bin/lm-bench" --model "$dir" --backend wgpu \
    --dtype f32 --kv-dtype int8 --batch 1 --batch 8 --prompt "$model_prompt" --new "$model_new" \
    --repeats 2
  for dtype in float32 bfloat16; do
    TAG="\"model\":\"$family\"," record 1 "$py" "$here/peer_lm.py" --model "$dir" \
      --device "$device" --dtype $dtype --batch 1,8 --prompt "$model_prompt" \
      --new "$model_new" --repeats 2
  done
done
# 9. Half precision, the core: ours and Burn's op in f16 on wgpu, SDPA in f16 and bf16.
for mode in fwd fwdbwd; do
  for seq in $core_seqs; do
    left "f16 core $mode $seq" || break 2
    shape=1x${seq}x768x12
    ours 1 --impl fused --core --mode $mode --shape "$shape" --dtype f16
    ours 1 --impl burn-op --core --mode $mode --shape "$shape" --dtype f16
    torch 1 --core --mode $mode --shapes "$shape" --dtype f16
    torch 1 --core --mode $mode --shapes "$shape" --dtype bf16
  done
done
# 10. Continuous batching (the continuous-batching issue): workload (a) through our engine on wgpu
# (lm-bench times our static batches of the same requests in the same call) and through
# transformers' continuous batching on the GPU, float32, on the models section 8 saved. Tagged
# `workload_set`.
workload_families=${WORKLOAD_FAMILIES:-gpt2}
workload_file=${WORKLOAD_FILE:-$here/../lm-bench/workloads/a-mixed.jsonl}
# Our engine's KV pool over every layer (lavapipe cannot allocate lm-bench's default 1 GiB).
workload_kv_mib=${WORKLOAD_KV_MIB:-1024}
for family in $workload_families; do
  dir="$models/$family"
  [ -d "$dir" ] || continue
  left "workload $family" || break
  TAG="\"workload_set\":\"$family\"," record 1 "$bin/lm-bench" --model "$dir" --backend wgpu \
    --workload "$workload_file" --kv-mib "$workload_kv_mib"
  TAG="\"workload_set\":\"$family\"," record 1 "$py" "$here/peer_lm.py" --model "$dir" \
    --device "$device" --workload "$workload_file"
done
rm -rf "$models"
python3 "$here/gpu_targets.py" "$out"
