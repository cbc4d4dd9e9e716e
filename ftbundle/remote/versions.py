"""The job interpreter's package versions, as it sees them: run by the probe
(ftbundle/remote/probe.py, ``versions``) under that interpreter as ``python -S -c TEXT --no-site
NAME...`` (then without -S and --no-site where a package is absent), and inside an image
(``image_versions``). Prints one JSON line: {"python": VERSION, NAME: VERSION or "absent", ...,
"_basis": [every path the answer rests on]}. Shipped as text within the probe
(ftbundle/check/__init__.py, ``probe_source``); standard library only.

Package versions as the job's interpreter sees them, without importlib.metadata (40-60 ms
in a large venv) or importing the packages (torch takes seconds): the .dist-info METADATA on
its sys.path, and torch's own version.py (its __version__ carries the build, 2.14.1+cu130).
First run with -S ("--no-site"): site.py's .pth files (setuptools' distutils hack, editable
finders, ...) cost a large venv's interpreter 25 ms of its 33 ms start. The site-packages
directories are then found as site.py finds them (a venv's pyvenv.cfg, its system site
packages, the user site). Only if a package is absent that way does the plain run (with
every .pth file) decide: a directory only a .pth file adds is still seen.
Its answer also names its basis ("_basis"): every directory it listed, every .pth file in
them and every file it read, which the probe's cache (:func:`versions`) stamps.
"""
import json, os, re, sys
basis = []
if sys.argv[1:2] == ["--no-site"]:
    del sys.argv[1]
    import site
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    cfg = next((c for c in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg"))
                if os.path.isfile(c)), None)
    basis.append(cfg or os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg"))
    dirs, system_site = [], True
    if cfg:
        with open(cfg, errors="replace") as f:
            conf = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition("=") for line in f) if _)
        system_site = conf.get("include-system-site-packages", "false").lower() == "true"
        dirs += site.getsitepackages([os.path.dirname(exe_dir)])
    if system_site:
        if site.check_enableusersite():
            dirs.append(site.getusersitepackages())
        dirs += site.getsitepackages()
    sys.path += [d for d in dirs if d not in sys.path]
try:  # (absent now, it would be on sys.path the moment it exists)
    import site
    basis.append(site.getusersitepackages())
except Exception:
    pass
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
want = {norm(n): n for n in sys.argv[1:]}
found = {}
for entry in sys.path:
    basis.append(os.path.abspath(entry or "."))
    try:
        names = os.listdir(entry or ".")
    except OSError:
        continue
    basis += [os.path.join(entry, d) for d in names if d.endswith(".pth")]
    for d in names:
        key = norm(d[:-10].rsplit("-", 1)[0]) if d.endswith(".dist-info") else None
        if key not in want or want[key] in found:
            continue
        name = want[key]
        basis += [os.path.join(entry, d, "METADATA"), os.path.join(entry, name, "version.py")]
        try:
            with open(os.path.join(entry, d, "METADATA"), errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        found[name] = line.split(":", 1)[1].strip()
                        break
            with open(os.path.join(entry, name, "version.py")) as f:
                found[name] = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M).group(1)
        except (OSError, AttributeError):
            pass
print(json.dumps({"python": sys.version.split()[0], **{n: found.get(n, "absent") for n in sys.argv[1:]},
                  "_basis": basis}))
