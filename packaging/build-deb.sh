#!/bin/bash
# Build the ate-devplugd .deb from a clean staging copy of the work tree.
#
#   packaging/build-deb.sh [--version VERSION] [--no-lintian] OUTDIR
#
# The staging copy holds the files git knows of (tracked, plus untracked ones
# that are not ignored), so a build works before a commit and never picks up
# build trees, caches or virtualenvs. packaging/debian becomes debian/ there,
# with its symlinks dereferenced. Missing build dependencies are installed with
# "apt-get satisfy". The .deb lands in OUTDIR; lintian must then report no
# error and no warning.
#
# --version VERSION adds a changelog entry with that version in the staging
# copy only (the package tests use it to build an upgrade).
set -euo pipefail

usage() { echo "usage: $0 [--version VERSION] [--no-lintian] OUTDIR" >&2; exit 2; }

version=""
lintian=1
outdir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --version) [ $# -ge 2 ] || usage; version=$2; shift 2 ;;
        --no-lintian) lintian=0; shift ;;
        -h|--help) usage ;;
        -*) usage ;;
        *) [ -z "$outdir" ] || usage; outdir=$1; shift ;;
    esac
done
[ -n "$outdir" ] || usage

top=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)

work=$(mktemp -d "${TMPDIR:-/tmp}/ate-devplugd-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
stage=$work/ate-devplugd

# Copy what git knows of; a tracked file deleted in the work tree is skipped.
mkdir "$stage"
(cd "$top" && git ls-files -z -co --exclude-standard) |
    (cd "$top" && while IFS= read -r -d '' f; do
        if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
    done) |
    tar -C "$top" --null --no-recursion -T - -cf - | tar -C "$stage" -xf -
cp -aL "$top/packaging/debian" "$stage/debian"

if [ -n "$version" ]; then
    {
        printf 'ate-devplugd (%s) unstable; urgency=medium\n\n' "$version"
        printf '  * Rebuild as version %s.\n\n' "$version"
        printf ' -- %s  %s\n\n' \
            "$(sed -n 's/^Maintainer: //p' "$stage/debian/control")" "$(date -R)"
        cat "$stage/debian/changelog"
    } >"$stage/debian/changelog.new"
    mv "$stage/debian/changelog.new" "$stage/debian/changelog"
fi

# The Debian version must carry the package's version (src/ate_devplugd/__init__.py, the one source).
py_version=$(sed -n 's/^__version__ *= *"\(.*\)"/\1/p' "$top/src/ate_devplugd/__init__.py" | head -n 1)
deb_version=$(cd "$stage" && dpkg-parsechangelog -S Version)
case "$deb_version" in
    "$py_version"|"$py_version"[+~.-]*) ;;
    *) echo "$0: debian/changelog version $deb_version does not match the package version $py_version (src/ate_devplugd/__init__.py)" >&2
       exit 1 ;;
esac

# Build dependencies, and lintian for the gate.
build_deps=$(cd "$stage" && perl -MDpkg::Control::Info -MDpkg::Deps -e \
    'print deps_parse(Dpkg::Control::Info->new("debian/control")->get_source->{"Build-Depends"})->output()')
need="dpkg-dev, $build_deps"
[ "$lintian" = 0 ] || need="$need, lintian"
if ! (cd "$stage" && dpkg-checkbuilddeps) >/dev/null 2>&1 ||
   { [ "$lintian" = 1 ] && ! command -v lintian >/dev/null; }; then
    echo "$0: installing build dependencies: $need" >&2
    satisfy() {
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 satisfy -y -q "$need" >&2
    }
    satisfy || { apt-get -o DPkg::Lock::Timeout=300 update -q >&2 && satisfy; }
fi

# pyproject.toml gives the licence as an SPDX expression (PEP 639,
# license = "Apache-2.0"), which setuptools reads from 77 on; older ones
# (Debian 12's is 66) refuse it and want the table form, which 77 and later
# warn is deprecated. Built with an older one, the staging copy gets the table
# form: the same licence.
setuptools_major=$(/usr/bin/python3 -c 'import setuptools; print(setuptools.__version__.split(".")[0])')
if [ "$setuptools_major" -lt 77 ]; then
    sed -i -e 's/^license = "\([^"]*\)"$/license = { text = "\1" }/' \
        -e 's/"setuptools>=77"/"setuptools>=66"/' "$stage/pyproject.toml"
    grep -q '^license = { text = ' "$stage/pyproject.toml" || {
        echo "$0: pyproject.toml: no license = \"...\" line to give setuptools $setuptools_major" >&2
        exit 1
    }
fi

# A clean environment: a virtualenv or pyenv shims on PATH make pybuild pick
# the wrong interpreter.
(cd "$stage" && env -i HOME="${HOME:-/root}" LC_ALL=C.UTF-8 \
    PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    dpkg-buildpackage -us -uc -b)

deb=$(cd "$work" && ls ate-devplugd_*_all.deb)
cp "$work/$deb" "$outdir/"
echo "$0: built $outdir/$deb" >&2

if [ "$lintian" = 1 ]; then
    changes=$(cd "$work" && ls ate-devplugd_*.changes)
    # -E: experimental tags, -v: verbose, -I: info tags, -L +pedantic: pedantic
    # tags too. Any error or warning fails the build.
    report=$(env -i HOME="${HOME:-/root}" LC_ALL=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        lintian -EvIL +pedantic --fail-on none "$work/$changes")
    printf '%s\n' "$report"
    if printf '%s\n' "$report" | grep -q '^[EW]: '; then
        echo "$0: lintian reported errors or warnings" >&2
        exit 1
    fi
fi
