#!/usr/bin/env python3
"""Renders kspeed's public Rust API, one item per line, from nightly
rustdoc's JSON output (scripts/api_listing.sh builds it and calls this).

    api_listing.py TARGET/doc/kspeed.json > api/kspeed.txt

Walks the crate from its root through public modules and `pub use`
re-exports, the way a user's `use kspeed::...` sees it, and writes every
public module, struct (with its pub fields and `#[non_exhaustive]`), enum
(with variants), trait, function and method signature, constant, static and
type alias, and each explicit trait impl. Items marked `#[doc(hidden)]` are
not in rustdoc's output, so not listed. The lines are sorted, so a change
shows as a small diff. A JSON shape this script does not know is printed as
`<?KEY>` instead of guessed, so a format change shows up as a diff too.
"""

import json
import sys


def die(msg):
    print(f"api_listing.py: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    if len(sys.argv) != 2:
        die("usage: api_listing.py KSPEED_JSON")
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    index = doc["index"]
    paths = doc.get("paths", {})
    out = set()

    def item(i):
        return index.get(str(i))

    def ty(t):
        if t is None:
            return "()"
        if isinstance(t, str):
            return "_" if t == "infer" else t
        (k, v), = t.items()
        if k == "primitive" or k == "generic":
            return v
        if k == "resolved_path":
            return path_ty(v)
        if k == "tuple":
            return "(" + ", ".join(ty(x) for x in v) + ("," if len(v) == 1 else "") + ")"
        if k == "slice":
            return f"[{ty(v)}]"
        if k == "array":
            return f"[{ty(v['type'])}; {v['len']}]"
        if k == "borrowed_ref":
            lt = v.get("lifetime")
            m = v.get("is_mutable", v.get("mutable"))
            return "&" + (lt + " " if lt else "") + ("mut " if m else "") + ty(v["type"])
        if k == "raw_pointer":
            m = v.get("is_mutable", v.get("mutable"))
            return ("*mut " if m else "*const ") + ty(v["type"])
        if k == "impl_trait":
            return "impl " + " + ".join(bound(b) for b in v)
        if k == "dyn_trait":
            parts = [path_ty(p["trait"]) for p in v["traits"]]
            if v.get("lifetime"):
                parts.append(v["lifetime"])
            return "dyn " + " + ".join(parts)
        if k == "qualified_path":
            tr = v.get("trait")
            base = f"<{ty(v['self_type'])} as {path_ty(tr)}>" if tr else ty(v["self_type"])
            return f"{base}::{v['name']}"
        if k == "function_pointer":
            s = v.get("sig", v.get("decl"))
            return "fn(" + ", ".join(ty(a[1]) for a in s["inputs"]) + ")" + ret(s.get("output"))
        return f"<?{k}>"

    def path_ty(p):
        name = p.get("path", p.get("name", "?"))
        # Items of this crate by their canonical path, others as written.
        summ = paths.get(str(p.get("id")))
        if summ and summ.get("crate_id") == 0:
            name = "::".join(summ["path"])
        return name + args(p.get("args"))

    def args(a):
        if not a:
            return ""
        (k, v), = a.items()
        if k == "angle_bracketed":
            parts = []
            for x in v.get("args", []):
                (ak, av), = x.items() if isinstance(x, dict) else (("infer", "_"),)
                parts.append(av if ak == "lifetime" else ty(av) if ak == "type" else str(av))
            for c in v.get("constraints", v.get("bindings", [])):
                b = c.get("binding", {})
                if "equality" in b:
                    eq = b["equality"]
                    parts.append(f"{c['name']} = {ty(eq.get('type', eq))}")
                else:
                    parts.append(f"{c['name']}: " + " + ".join(bound(x) for x in b.get("constraint", [])))
            return "<" + ", ".join(parts) + ">" if parts else ""
        if k == "parenthesized":
            return "(" + ", ".join(ty(x) for x in v["inputs"]) + ")" + ret(v.get("output"))
        return f"<?{k}>"

    def bound(b):
        if isinstance(b, str):
            return b
        (k, v), = b.items()
        if k == "trait_bound":
            mod = "?" if v.get("modifier") == "maybe" else ""
            return mod + path_ty(v["trait"])
        if k == "outlives":
            return v
        return f"<?{k}>"

    def ret(o):
        return "" if o is None else " -> " + ty(o)

    def generics(g):
        if not g:
            return ""
        ps = []
        for p in g.get("params", []):
            (k, v), = p["kind"].items()
            if k == "lifetime":
                ps.append(p["name"])
            elif k == "type":
                if v.get("is_synthetic", v.get("synthetic")):
                    continue
                bs = v.get("bounds", [])
                ps.append(p["name"] + (": " + " + ".join(bound(b) for b in bs) if bs else ""))
            elif k == "const":
                ps.append(f"const {p['name']}: {ty(v['type'])}")
        return "<" + ", ".join(ps) + ">" if ps else ""

    def where(g):
        preds = []
        for w in (g or {}).get("where_predicates", []):
            (k, v), = w.items()
            if k == "bound_predicate":
                preds.append(ty(v["type"]) + ": " + " + ".join(bound(b) for b in v["bounds"]))
            else:
                preds.append(f"<?{k}>")
        return " where " + ", ".join(preds) if preds else ""

    def fn_line(name, f):
        h = f.get("header", {})
        q = ""
        if h.get("is_const", h.get("const")):
            q += "const "
        if h.get("is_unsafe", h.get("unsafe")):
            q += "unsafe "
        abi = h.get("abi")
        if isinstance(abi, dict) and "C" in abi:
            q += 'extern "C" '
        s = f.get("sig", f.get("decl"))
        ins = []
        for n, t in s["inputs"]:
            ins.append(n if n == "self" else f"{n}: {ty(t)}")
            if n == "self":
                ins[-1] = {"&Self": "&self", "&mut Self": "&mut self", "Self": "self"}.get(ty(t), f"self: {ty(t)}")
        return f"pub {q}fn {name}{generics(f.get('generics'))}({', '.join(ins)}){ret(s.get('output'))}{where(f.get('generics'))}"

    def attrs(it):
        a = []
        for x in it.get("attrs", []):
            s = x if isinstance(x, str) else json.dumps(x)
            if "non_exhaustive" in s:
                a.append("#[non_exhaustive] ")
            if "repr(C)" in s or '"c"' in s.lower() and "repr" in s:
                a.append("#[repr(C)] ")
        return "".join(sorted(set(a)))

    def impls(owner, ids):
        for iid in ids:
            im = item(iid)
            if not im:
                continue
            v = im["inner"]["impl"]
            if v.get("is_synthetic", v.get("synthetic")) or v.get("blanket_impl"):
                continue
            tr = v.get("trait")
            if tr:
                # The type by the path it was reached through (its
                # defining module may be private).
                line = f"impl{generics(v.get('generics'))} {path_ty(tr)} for {owner}"
                out.add(f"{line}{where(v.get('generics'))}")
                continue
            for mid in v["items"]:
                m = item(mid)
                if not m or m.get("visibility") != "public":
                    continue
                (k, mv), = m["inner"].items()
                if k == "function":
                    out.add(fn_line(f"{owner}::{m['name']}", mv))
                elif k == "assoc_const":
                    out.add(f"pub const {owner}::{m['name']}: {ty(mv['type'])}")
                else:
                    out.add(f"pub {k} {owner}::{m['name']}")

    seen = set()

    def visit(iid, path, via_use=False):
        it = item(iid)
        if it is None or it.get("crate_id", 0) != 0:
            if it is None and path:
                out.add(f"pub use {path} (external or hidden)")
            return
        if (iid, path) in seen:
            return
        seen.add((iid, path))
        (k, v), = it["inner"].items()
        if k == "module":
            out.add(f"pub mod {path}")
            for c in v["items"]:
                ci = item(c)
                if ci is None:
                    continue
                if ci.get("visibility") != "public" and "use" not in ci["inner"]:
                    continue
                (ck, cv), = ci["inner"].items()
                if ck == "use":
                    if ci.get("visibility") != "public":
                        continue
                    if cv.get("is_glob", cv.get("glob")):
                        tgt = item(cv.get("id"))
                        if tgt and "module" in tgt["inner"]:
                            for g in tgt["inner"]["module"]["items"]:
                                gi = item(g)
                                if gi and gi.get("visibility") == "public" and gi.get("name"):
                                    visit(g, f"{path}::{gi['name']}")
                        else:
                            out.add(f"pub use {path}::{cv['source']}::*")
                    elif cv.get("id") is not None and item(cv["id"]) is not None:
                        visit(cv["id"], f"{path}::{cv['name']}")
                    else:
                        out.add(f"pub use {path}::{cv['name']} = {cv['source']}")
                    continue
                if ci.get("name") is None:
                    continue
                visit(c, f"{path}::{ci['name']}")
        elif k == "struct":
            out.add(f"{attrs(it)}pub struct {path}{generics(v.get('generics'))}")
            sk = v["kind"]
            if isinstance(sk, dict) and "plain" in sk:
                for fid in sk["plain"]["fields"]:
                    f = item(fid)
                    if f and f.get("visibility") == "public":
                        out.add(f"pub {path}.{f['name']}: {ty(f['inner']['struct_field'])}")
            elif isinstance(sk, dict) and "tuple" in sk:
                for n, fid in enumerate(sk["tuple"]):
                    f = item(fid) if fid is not None else None
                    if f and f.get("visibility") == "public":
                        out.add(f"pub {path}.{n}: {ty(f['inner']['struct_field'])}")
            impls(path, v.get("impls", []))
        elif k == "enum":
            out.add(f"{attrs(it)}pub enum {path}{generics(v.get('generics'))}")
            for vid in v["variants"]:
                var = item(vid)
                if not var:
                    continue
                vk = var["inner"]["variant"]["kind"]
                desc = ""
                if isinstance(vk, dict) and "tuple" in vk:
                    desc = "(" + ", ".join(
                        ty(item(f)["inner"]["struct_field"]) if f is not None and item(f) else "_"
                        for f in vk["tuple"]
                    ) + ")"
                elif isinstance(vk, dict) and "struct" in vk:
                    desc = " { " + ", ".join(
                        f"{item(f)['name']}: {ty(item(f)['inner']['struct_field'])}"
                        for f in vk["struct"]["fields"]
                        if item(f)
                    ) + " }"
                out.add(f"{attrs(var)}pub {path}::{var['name']}{desc}")
            impls(path, v.get("impls", []))
        elif k == "union":
            out.add(f"pub union {path}")
            impls(path, v.get("impls", []))
        elif k == "function":
            out.add(fn_line(path, v))
        elif k == "constant":
            out.add(f"pub const {path}: {ty(v.get('type'))}")
        elif k == "static":
            out.add(f"pub static {path}: {ty(v.get('type'))}")
        elif k == "type_alias":
            out.add(f"pub type {path}{generics(v.get('generics'))} = {ty(v.get('type'))}")
        elif k == "trait":
            out.add(f"pub {'unsafe ' if v.get('is_unsafe') else ''}trait {path}{generics(v.get('generics'))}")
            for mid in v.get("items", []):
                m = item(mid)
                if m and "function" in m["inner"]:
                    out.add(fn_line(f"{path}::{m['name']}", m["inner"]["function"]))
                elif m:
                    (mk, _), = m["inner"].items()
                    out.add(f"pub {mk} {path}::{m['name']}")
        elif k == "macro":
            out.add(f"pub macro {path}!")
        else:
            out.add(f"pub {k} {path}")

    root = item(doc["root"])
    visit(doc["root"], root["name"])
    for line in sorted(out):
        print(line)


main()
