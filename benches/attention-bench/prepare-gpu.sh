#!/usr/bin/env bash
# What run-gpu.sh needs on the device machine, made here: the release binaries stripped and
# xz-compressed in .gpu/ (attention-bench, lm-bench: about 8 MB each), the Vulkan loader's Debian
# packages in .gl/ (the device has NVIDIA's driver but no loader), and both folders in
# .git/info/exclude so that they travel only when a device call carries them.
#   benches/attention-bench/prepare-gpu.sh
# Then, in one device call carrying .gpu and .gl, as run-gpu.sh's header says.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cargo build --release -p attention-bench -p lm-bench
mkdir -p .gpu .gl /tmp/amd64/partial
for name in attention-bench lm-bench; do
  strip -o ".gpu/$name" "target/release/$name"
  xz -9 -f ".gpu/$name"
done
for dir in /.gpu/ /.gl/; do
  grep -qxF "$dir" .git/info/exclude || echo "$dir" >> .git/info/exclude
done
apt_options=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
apt-get "${apt_options[@]}" update -qq
(cd .gl && apt-get "${apt_options[@]}" download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 \
  libglx0 libgles2)
du -ch .gpu/* .gl/* | tail -1
