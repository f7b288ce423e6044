#!/usr/bin/env bash
# Builds kspeed and its C ABI crate kspeed-capi (capi/; release) and installs
# the C/C++ package under PREFIX
# (default /usr/local):
#   PREFIX/bin/kspeed
#   PREFIX/lib/libkspeed.so.VERSION, libkspeed.so.ABI -> it, libkspeed.so -> it, libkspeed.a
#   PREFIX/include/kspeed.h, kspeed.hpp
#   PREFIX/lib/pkgconfig/kspeed.pc
#   PREFIX/lib/cmake/kspeed/kspeedConfig.cmake, kspeedConfigVersion.cmake
# Extra cargo flags go in CARGO_FLAGS (e.g. --no-default-features --features cli
# for a build without RDMA; the kspeed command needs the cli feature).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-/usr/local}"
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
abi=$(sed -n 's/^    let abi = \([0-9]*\);/\1/p' capi/build.rs)
major=${version%%.*}; rest=${version#*.}; minor=${rest%%.*}
# The kspeed command and the C library: cargo names kspeed-capi's outputs
# libkspeed_capi.so (soname libkspeed.so.ABI, from capi/build.rs) and
# libkspeed_capi.a; they are installed as libkspeed.*.
cargo build --release --quiet -p kspeed -p kspeed-capi ${CARGO_FLAGS:-}
# What a static link needs besides libkspeed.a (libibverbs with the rdma feature).
privlibs="-lpthread -ldl -lm"
case " ${CARGO_FLAGS:-} " in *" --no-default-features "*) ;; *) privlibs="$privlibs -libverbs" ;; esac
cmake_privlibs=$(echo "$privlibs" | sed -e 's/-l//g' -e 's/ /;/g')
rel=target/release
install -d "$prefix/bin" "$prefix/lib/pkgconfig" "$prefix/lib/cmake/kspeed" "$prefix/include"
install -m 755 "$rel/kspeed" "$prefix/bin/kspeed"
install -m 755 "$rel/libkspeed_capi.so" "$prefix/lib/libkspeed.so.$version"
ln -sf "libkspeed.so.$version" "$prefix/lib/libkspeed.so.$abi"
ln -sf "libkspeed.so.$abi" "$prefix/lib/libkspeed.so"
install -m 644 "$rel/libkspeed_capi.a" "$prefix/lib/libkspeed.a"
install -m 644 include/kspeed.h ffi/cpp/kspeed.hpp "$prefix/include/"
subst() { sed -e "s|@PREFIX@|$prefix|g" -e "s|@VERSION@|$version|g" -e "s|@ABI@|$abi|g" \
              -e "s|@MAJOR@|$major|g" -e "s|@MINOR@|$minor|g" -e "s|@PRIVLIBS@|$privlibs|g" \
              -e "s|@CMAKE_PRIVLIBS@|$cmake_privlibs|g" "$1" > "$2"; }
subst packaging/kspeed.pc.in "$prefix/lib/pkgconfig/kspeed.pc"
subst packaging/kspeedConfig.cmake.in "$prefix/lib/cmake/kspeed/kspeedConfig.cmake"
subst packaging/kspeedConfigVersion.cmake.in "$prefix/lib/cmake/kspeed/kspeedConfigVersion.cmake"
echo "installed kspeed $version (C ABI $abi) under $prefix"
