#!/usr/bin/env bash
# Packs SGLang 0.5.16 for the GPU machine (Python 3.12, torch 2.11.0+cu130, no registry) into
# .sglang-bundle/ at the root of this checkout: one gzip tarball of a site-packages tree, split
# into parts that each fit one device call beside the working tree (64 MiB a call).
#
# What goes in: sglang 0.5.16, sglang-kernel 0.4.5 with its Hopper ops only, and the packages a
# text-only server imports that the GPU image lacks or holds at a version sglang refuses
# (transformers 5.17 there clashes with sglang's own qwen3_asr config; sglang's pin 5.12.1 needs
# tokenizers <= 0.23.0). The list was found on a CPU by importing the server's modules (launch_server,
# http_server, scheduler, tokenizer and detokenizer managers, model_runner, models.qwen2, the triton
# attention backend, the sampler, flashinfer.sampling) with every package the GPU image lacks hidden;
# code that runs only on CUDA may import more (docs/gpu.md, SGLang on the GPU machine).
#
# What is dropped, and why it is safe for a Qwen2/Llama rollout server on an H100/H200 started
# with `--attention-backend triton` (docs/sglang.md):
#   sgl_kernel/flash_ops.abi3.so (1.12 GB, FlashAttention 3): only the fa3 attention backend and
#     vision towers import it (sgl_kernel.flash_attn); the triton backend does not.
#   sgl_kernel/flashmla_ops.abi3.so, infllm_ops*.so: MLA (DeepSeek) and InfLLM-V2 attention,
#     loaded only when those backends run.
#   sgl_kernel/sm100/: Blackwell's build of the common ops; Hopper loads sgl_kernel/sm90/.
#   sglang/multimodal_gen, sglang/test: the diffusion server and SGLang's own test suite.
#   xgrammar/lib/libxgrammar.a: a static library for linking, never loaded.
#
# Usage (from the project's root):   bench/gpu_sglang_bundle.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
out=.sglang-bundle
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
PART_MIB=${PART_MIB:-58}

# Pinned by sglang 0.5.16 where it pins; the others at the versions the server ran with.
packages=(
  sglang==0.5.16 sglang-kernel==0.4.5 flashinfer_python==0.6.14 torch_memory_saver==0.0.10
  transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 apache-tvm-ffi==0.1.11 openai==2.6.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.3 python-multipart==0.0.34
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  orjson==3.13.0 pyzmq==27.3.0 pybase64==1.5.1 msgspec==0.23.0 setproctitle==1.3.8
  ipython==9.19.1 traitlets==5.16.1 dill==0.4.1 distro==1.9.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  compressed-tensors==0.20.1 loguru==0.8.0 gguf==0.19.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
python3 -m pip install -q --no-deps --no-compile --target "$site" --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${packages[@]}"
rm -rf "$site"/sgl_kernel/flash_ops.abi3.so "$site"/sgl_kernel/flashmla_ops.abi3.so \
  "$site"/sgl_kernel/infllm_ops*.so "$site"/sgl_kernel/sm100 \
  "$site"/sglang/multimodal_gen "$site"/sglang/test "$site"/xgrammar/lib
find "$site" -name __pycache__ -prune -exec rm -rf {} +
test -f "$site/sgl_kernel/sm90/common_ops.abi3.so"
echo "unpacked: $(du -sh "$site" | cut -f1)"
rm -rf "$out"; mkdir -p "$out"
# gzip, not xz: on a busy two-core machine xz took over ten minutes for what gzip packs in seconds.
tar -C "$site" -cf - . | gzip -5 | split -b "${PART_MIB}m" -d - "$out/site.tar.gz.part"
ls -l "$out"
cat <<EOF
# $(ls "$out" | wc -l) part(s): carry one a call, back to back (a warm machine keeps the earlier
# ones), e.g. carry [".sglang-bundle/site.tar.gz.part00"]; then, on the GPU machine:
mkdir -p /tmp/sglang-site && cat .sglang-bundle/site.tar.gz.part* | tar -xz -C /tmp/sglang-site && export PYTHONPATH=/tmp/sglang-site:\$PWD/trainer:\$PWD/api:\$PWD || exit 1
EOF
