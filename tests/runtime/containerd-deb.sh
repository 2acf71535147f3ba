#!/bin/bash
# containerd 2.x as Debian packages it, for the CRI tests: the .deb of a newer suite, unpacked.
#
#   tests/runtime/containerd-deb.sh        # build (or find) the unpacked package; print its directory
#
# Debian ships containerd 2.x in forky and sid only, and its containerd, containerd-shim-runc-v2 and
# ctr link only libc: they run on Debian 12 as they are (the host's runc runs the containers). So
# no tree is built: the one package is downloaded with apt-get, through an apt configuration of its
# own under the cache directory (its sources, lists and archives; the host's sources and its
# package state are never read nor changed, while its apt.conf.d settings, a proxy or how Release
# files are checked, apply as to any apt run here), checked by apt against the suite's signed
# Release file (the host's debian-archive-keyring), and unpacked with dpkg-deb -x.
#
# Which version: the newest one in forky or sid matching VERSION_PATTERN (a glob on Debian's
# version). When the suites no longer offer it, this fails saying what they offer: the pattern is
# then moved on here, and the tests follow the series they are given (tests/runtimes/containerd.py).
#
# Cached in .cache/runtime/containerd-<key>/ (root/usr/bin/containerd ..., packages.txt, complete),
# where <key> hashes the suites, the pattern and this script, so a fresh checkout or a change here
# builds it anew; older ones are removed. Under .cache/runtime/containerd.lock: exclusive while
# building, shared after (tests/runtimes/containerd.py holds it shared while a containerd runs).
# Needs root (apt's downloads) and access to deb.debian.org; takes about 10 s.
set -euo pipefail

package=containerd
VERSION_PATTERN='2.1.9+ds1-*'
suites=(forky sid)
mirror=http://deb.debian.org/debian
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
script=$here/$(basename "${BASH_SOURCE[0]}")

say() { printf 'containerd-deb: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }
[ "$(id -u)" = 0 ] || die "must run as root (apt-get's downloads)"
[ -r "$keyring" ] || die "no $keyring (apt-get install debian-archive-keyring)"

cache=$top/.cache/runtime
key=$( { printf '%s\n' "$package" "$VERSION_PATTERN" "${suites[*]}" "$mirror"; cat "$script"; } |
    sha256sum | cut -c1-16)
dir=$cache/$package-$key
mkdir -p "$cache"
exec 9>"$cache/$package.lock"
flock 9
if [ ! -f "$dir/complete" ]; then
    start=$SECONDS
    tmp=$dir.tmp
    rm -rf --one-file-system "$tmp"
    mkdir -p "$tmp/apt/etc/sources.list.d" "$tmp/apt/etc/preferences.d" "$tmp/apt/state/lists/partial" \
        "$tmp/apt/cache/archives/partial" "$tmp/deb"
    for suite in "${suites[@]}"; do
        echo "deb [signed-by=$keyring] $mirror $suite main"
    done >"$tmp/apt/etc/sources.list"
    : >"$tmp/apt/state/status"
    apt=(-q -o "Dir::Etc::sourcelist=$tmp/apt/etc/sources.list" -o "Dir::Etc::sourceparts=$tmp/apt/etc/sources.list.d"
         -o "Dir::Etc::preferencesparts=$tmp/apt/etc/preferences.d" -o "Dir::Etc::preferences=$tmp/apt/etc/preferences"
         -o "Dir::State=$tmp/apt/state" -o "Dir::State::status=$tmp/apt/state/status" -o "Dir::Cache=$tmp/apt/cache"
         -o APT::Sandbox::User=root)
    say "reading ${suites[*]} from $mirror (a private apt configuration in $tmp/apt)"
    apt-get "${apt[@]}" update >"$tmp/apt.log" 2>&1 || { tail -n 20 "$tmp/apt.log" >&2; die "apt-get update failed"; }
    offered=$(apt-cache "${apt[@]}" madison "$package" | awk -F' [|] ' '{print $2}')
    version=
    while read -r candidate; do
        # shellcheck disable=SC2053 # a glob match, on purpose
        if [[ $candidate == $VERSION_PATTERN ]] &&
            { [ -z "$version" ] || dpkg --compare-versions "$candidate" gt "$version"; }; then
            version=$candidate
        fi
    done <<<"$offered"
    [ -n "$version" ] || die "${suites[*]} offer $package $(echo "$offered" | paste -sd' ' -), none matching" \
        "$VERSION_PATTERN (move VERSION_PATTERN in $script on)"
    (cd "$tmp/deb" && apt-get "${apt[@]}" download "$package=$version") >>"$tmp/apt.log" 2>&1 ||
        { tail -n 20 "$tmp/apt.log" >&2; die "apt-get download $package=$version failed"; }
    mkdir "$tmp/root"
    dpkg-deb -x "$tmp"/deb/*.deb "$tmp/root"
    echo "$package $version" >"$tmp/packages.txt"
    rm -rf --one-file-system "$tmp/apt" "$tmp/deb"
    "$tmp/root/usr/bin/containerd" --version >/dev/null ||
        die "$package $version's containerd does not run here"
    find "$cache" -mindepth 1 -maxdepth 1 -name "$package-*" -not -name "$package-$key.tmp" \
        -exec rm -rf --one-file-system {} +
    mv "$tmp" "$dir"
    touch "$dir/complete"
    say "$package $version unpacked in $((SECONDS - start))s"
fi
flock -s 9
say "$package $(cut -d' ' -f2 "$dir/packages.txt") is in $dir"
echo "$dir"
