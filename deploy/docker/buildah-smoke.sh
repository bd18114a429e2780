#!/usr/bin/env bash
# Builds the Dockerfile with buildah (daemonless; Debian's package) and smoke-tests the image with `buildah run`, as
# the image's own non-root user: `baton --help`, then make-model and generate on a tiny model (on the CPU).
# BASE_IMAGE=debootstrap makes a minimal Debian rootfs (debootstrap, Debian's package) stand in for the CUDA base, for
# machines that reach no container registry; every other step of the Dockerfile runs unchanged.
# Usage: deploy/docker/buildah-smoke.sh [TAG]    env: BASE_IMAGE (debootstrap or an image), BUILDAH_STORAGE (vfs)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/^appVersion: "\(.*\)"$/\1/p' deploy/helm/baton/Chart.yaml)
tag=${1:-localhost/baton-serve:$version}
b=(buildah --storage-driver "${BUILDAH_STORAGE:-vfs}")
args=()
scratch=$(mktemp -d)
ctr=""
cleanup() {
  [ -z "$ctr" ] || "${b[@]}" rm "$ctr" >/dev/null
  rm -rf "$scratch"
}
trap cleanup EXIT

if [ "${BASE_IMAGE:-}" = debootstrap ]; then
  debootstrap --variant=minbase bookworm "$scratch/rootfs" >"$scratch/debootstrap.log"
  ctr=$("${b[@]}" from scratch)
  "${b[@]}" copy "$ctr" "$scratch/rootfs" / >/dev/null
  "${b[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  "${b[@]}" commit -q "$ctr" localhost/baton-debian-base:bookworm >/dev/null
  "${b[@]}" rm "$ctr" >/dev/null
  ctr=""
  args+=(--build-arg BASE_IMAGE=localhost/baton-debian-base:bookworm)
elif [ -n "${BASE_IMAGE:-}" ]; then
  args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
# Behind a TLS-intercepting proxy the host's pip trusts its CA through PIP_CERT; pip inside the build is lent the same.
if [ -n "${PIP_CERT:-}" ]; then
  printf '[global]\ncert = /run/host-ca.crt\n' >"$scratch/pip.conf"
  args+=(-v "$PIP_CERT:/run/host-ca.crt:ro" -v "$scratch/pip.conf:/etc/pip.conf:ro")
fi

"${b[@]}" bud --isolation chroot "${args[@]}" -t "$tag" .

ctr=$("${b[@]}" from "$tag")
run=("${b[@]}" run --isolation chroot "$ctr" --)
uid=$("${run[@]}" id -u)
[ "$uid" != 0 ] || { echo "the image runs as root" >&2; exit 1; }
"${run[@]}" baton --help >/dev/null
"${run[@]}" baton make-model /tmp/tiny --preset tiny --seed 0
"${run[@]}" baton generate --model /tmp/tiny --prompt-ids "1 2 3" --max-tokens 4 --ignore-eos --json --device cpu
echo "$tag: built; baton --help, make-model and generate ran as uid $uid"
