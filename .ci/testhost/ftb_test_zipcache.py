"""Test hosts only (.ci/testhost-image.sh): a bytecode cache for what Python imports from zip files.

Every Ansible task runs its module as an AnsiballZ payload: a zip of the module and Ansible's
module_utils, imported with zipimport, which compiles every .py it imports from a zip on
every run and never keeps a .pyc. On these hosts that compile was about 40% of a module's CPU
(0.39 s -> 0.24 s for ansible.builtin.stat, ansible-core 2.19), and Ansible's modules on the
test hosts were the largest CPU consumer of `make test` (about 20 of 52 CPU minutes in the
Molecule modules' first 36 minutes, measured with process accounting).

The compiled code object is kept under /var/cache/ftb-test-zipimport, keyed by the Python
version, the path inside the zip and the source bytes, so the same source always gives the
same code. It changes nothing a role does or sees; where the cache cannot be written
(a task run as another user), the module is compiled as before. Not part of the product:
real hosts do not have it and do not need it.
"""

import hashlib
import marshal
import os
import sys
import zipimport

_DIR = "/var/cache/ftb-test-zipimport"
_compile = zipimport._compile_source


def _compile_source(pathname, source):
    inner = pathname.rsplit(".zip" + os.sep, 1)[-1]
    key = hashlib.sha256(sys.version.encode() + b"\0" + inner.encode() + b"\0" + source).hexdigest()
    path = os.path.join(_DIR, key)
    try:
        with open(path, "rb") as f:
            return marshal.loads(f.read())
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = _compile(pathname, source)
    try:
        os.makedirs(_DIR, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(tmp, path)
    except OSError:
        pass
    return code


zipimport._compile_source = _compile_source
