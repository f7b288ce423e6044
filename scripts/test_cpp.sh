#!/usr/bin/env bash
# The C++ side end to end: installs kspeed under a temporary prefix
# (scripts/install.sh), builds examples/cpp/trainer.cpp against that install
# with CMake (find_package(kspeed)) and with pkg-config, and runs both on a
# generated, preloaded dataset (every sample's CRC32C checked against the
# catalog; 2 ranks of the same job cover the epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/kspeed-cpp.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
scripts/install.sh "$prefix"
export PATH="$prefix/bin:$PATH"

echo "-- CMake: find_package(kspeed)"
cmake -S examples/cpp -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" >/dev/null
echo "-- pkg-config kspeed: $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --modversion kspeed)"
g++ -std=c++17 -O2 -Wall -Wextra -Werror examples/cpp/trainer.cpp -o "$work/trainer-pc" \
    $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs kspeed) \
    -Wl,-rpath,"$prefix/lib"
echo "-- static: libkspeed.a"
g++ -std=c++17 -O2 examples/cpp/trainer.cpp -o "$work/trainer-static" -I"$prefix/include" \
    "$prefix/lib/libkspeed.a" \
    $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --static --libs-only-l kspeed | sed 's/-lkspeed//')

kspeed gen --profile imagenet --count 600 --out "$work/src" >/dev/null
kspeed --progress none preload --source "$work/src" --space "$work/space" >/dev/null
"$work/build/trainer" "$work/space" 3 32
"$work/trainer-pc" "$work/space" 2 64 0 2
"$work/trainer-pc" "$work/space" 2 64 1 2
"$work/trainer-static" "$work/space" 1 16
# A missing space is a clear error, not a crash.
if "$work/build/trainer" "$work/nothing-here" 2> "$work/err"; then
    echo "trainer on a missing space succeeded" >&2; exit 1
fi
grep -q "nothing-here" "$work/err" || { cat "$work/err"; exit 1; }
echo "C++ example: ok"
