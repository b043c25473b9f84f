#!/usr/bin/env bash
# Finds a working CRIU >= 4.1 for `preload snapshot`, or builds one into .venv/bin/criu.
#
# Debian 12's criu (3.17) fails on recent kernels (the vDSO layout changed), so on a Debian host
# without a working CRIU this builds 4.1.x from Debian's source package (trixie), with the build
# dependencies from the host's own release. Nothing is downloaded but Debian packages.
#
# Exit status: 0 when a working CRIU is in place, 3 when none is and this host cannot build one (it
# says why), 1 when a build that should have worked failed. PRELOAD_CRIU=/path/to/criu skips all of it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
DEST=$VENV/bin/criu
WORK=$VENV/criu-build
MIN_MAJOR=4 MIN_MINOR=1

say() { echo "install_criu: $*" >&2; }

works() {  # works CRIU: version >= 4.1 and `criu check` passes on this kernel
  local bin=$1 ver
  [ -x "$bin" ] || return 1
  ver=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *//p')
  [ -n "$ver" ] || return 1
  local major=${ver%%.*} rest=${ver#*.}
  local minor=${rest%%.*}
  if [ "$major" -lt $MIN_MAJOR ] || { [ "$major" -eq $MIN_MAJOR ] && [ "$minor" -lt $MIN_MINOR ]; }; then
    say "$bin is CRIU $ver; snapshots need >= $MIN_MAJOR.$MIN_MINOR"
    return 1
  fi
  "$bin" check >/dev/null 2>&1 || { say "$bin ($ver): 'criu check' fails on this kernel"; return 1; }
}

for bin in "${PRELOAD_CRIU:-}" "$DEST" "$(command -v criu || true)"; do
  if [ -n "$bin" ] && works "$bin"; then
    say "using $bin"
    exit 0
  fi
done

# Debian itself (its archive key signs the trixie sources): on another apt host (Ubuntu) that entry
# would break every `apt-get update` there.
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
os_id=$( (. /etc/os-release && echo "${ID:-}") 2>/dev/null || true)
if [ "$(uname -s)" != Linux ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
    || [ "$os_id" != debian ] || [ ! -r "$keyring" ]; then
  say "no working CRIU >= 4.1 here, and building one needs root on Debian (with its archive keyring);"
  say "snapshots are unavailable until one is installed (PRELOAD_CRIU=/path/to/criu)"
  exit 3
fi

say "building CRIU from Debian's source package (about a minute)"
apt_q() { DEBIAN_FRONTEND=noninteractive apt-get -qq -o Dpkg::Use-Pty=0 "$@" >/dev/null; }
# The trixie source entry stands only while this runs (written whole, then moved into place), and
# apt's lists are refreshed without it afterwards.
src_list=/etc/apt/sources.list.d/preload-criu-src.sources
drop_src() { rm -f "$src_list" "$src_list.tmp"; apt_q update || true; }
trap drop_src EXIT
cat > "$src_list.tmp" <<EOF
# Added by preload's scripts/install_criu.sh while it builds CRIU 4.1: source packages only.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: $keyring
EOF
mv "$src_list.tmp" "$src_list"
apt_q update
apt_q install -y --no-install-recommends build-essential pkg-config xz-utils \
  libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler libnl-3-dev libnet1-dev \
  libcap-dev libaio-dev libgnutls28-dev libbsd-dev libdrm-dev uuid-dev python3-protobuf

rm -rf "$WORK" && mkdir -p "$WORK"
# The .dsc may be missing from the mirror; the upstream tarball is all the build needs.
(cd "$WORK" && apt-get source -qq --download-only criu >/dev/null 2>&1 || true)
tarball=$(ls "$WORK"/criu_4.*.orig.tar.* 2>/dev/null | sort -V | tail -n 1 || true)
[ -n "$tarball" ] || { say "could not download CRIU's source package from Debian trixie"; exit 1; }
tar -xf "$tarball" -C "$WORK"
srcdir=$(find "$WORK" -maxdepth 1 -mindepth 1 -type d -name 'criu-*' | head -n 1)
make -C "$srcdir" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 \
  || { say "build failed; see $WORK/build.log"; tail -n 20 "$WORK/build.log" >&2; exit 1; }
install -m 0755 "$srcdir/criu/criu" "$DEST"
rm -rf "$srcdir"
works "$DEST" || { say "built $DEST but it does not work here"; "$DEST" check >&2 || true; exit 1; }
say "installed $("$DEST" --version | sed -n 's/^Version: *//p') at $DEST"
