#!/usr/bin/env bash
# A/B of the fused MoE kernels on this GPU, back to back: benchmarks/moe_layer.py at a baseline
# commit (checked out into a temporary git worktree) or in a directory holding another checkout
# (where there is no git repository, e.g. `git archive REV frugal benchmarks` unpacked), then at
# this tree, with the same arguments. Writes base.json and new.json into $OUT (default: the
# current directory).
#   bash benchmarks/moe_ab.sh BASE_REV|BASE_DIR [moe_layer.py arguments]
#   bash benchmarks/moe_ab.sh fab8390 --model qwen3-30b-a3b --tokens 1,8,16,64 --calls 16
set -euo pipefail
base=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(cd "${OUT:-.}" && pwd)
if [ -d "$base" ]; then
    src_base=$(cd "$base" && pwd)
else
    dir=$(mktemp -d)
    git -C "$root" worktree add -f --detach "$dir/base" "$base" > /dev/null
    trap 'git -C "$root" worktree remove --force "$dir/base"; rm -rf "$dir"' EXIT
    src_base=$dir/base
fi
label() {  # the commit of a checkout, else its directory
    git -C "$1" rev-parse --short HEAD 2> /dev/null || echo "$1"
}
for side in base new; do
    src=$root
    [ "$side" = base ] && src=$src_base
    dirty=""
    [ "$side" = new ] && git -C "$root" rev-parse 2> /dev/null && ! git -C "$root" diff --quiet HEAD \
        && dirty=" + uncommitted changes"
    echo "== $side: $(label "$src")$dirty"
    (cd "$src/benchmarks" && PYTHONPATH="$src" python moe_layer.py "$@" --json "$out/$side.json")
done
