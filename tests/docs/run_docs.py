#!/usr/bin/env python3
"""docs/examples: every fenced block of README.md, CONTRIBUTING.md and
docs/*.md runs, so that a wrong claim in the docs fails a test.

Each block runs according to its language and an optional directive, an HTML
comment on the line just before its fence (it does not render):

    <!-- doc-test: MODE [key=value ...] [(reason)] -->

Without a directive: sh, python, lua, c and cmake blocks run in their
default mode; an unlabelled block (output, a tree, trace lines) FAILS until
a directive says what it is. Modes and options:

  sh        every command (continuation lines joined, comment lines
            dropped) runs with `bash -o pipefail`, must exit 0; a `jq` at the
            end of a pipeline must print no `null` (a field the JSON lacks).
            except=N,M (reason): the block's lines N, M are not run;
            swap=A:B (reason): A is replaced by B in every command;
            ctest=list: `ctest` commands run with -N and must select tests;
            needs=PROG: skipped (said) where PROG is not installed;
            creates=F,G: files (globs) the commands must have made.
  python    the block, after `import torch` and the named fixture (a tiny
            real torch model; FIXTURES below), runs to completion with the
            torch 1.x interpreter. fixture=NAME, import=MOD[,MOD] (a block
            that continues an earlier one of its page), creates=F,
            torch=2 (reason): needs the torch 2.x interpreter
            ($FERRY_DOCS_TORCH2, else the venv .ci/python-env keeps, which
            tests/run_all.sh makes first); without one the block is skipped with the
            reason, and under CI=true that fails, as tests/python/run.sh does.
  lua       a policy (a top-level `return`) is checked with `ferry check
            FILE` (exit 0, 0 faults); a rules-library fragment is split into
            its items and each is checked inside `R.policy { name = ..., ITEM }`;
            a script that requires "ferry" (the FFI module) runs under
            luajit. save-as=NAME keeps the block as a fixture file of the
            work dirs (mine.lua is the README's policy); expect=TEXT: the
            last line printed.
  c         statements are wrapped in `int main(void)` after <ferry.h> and
            the named fixture (FIXTURES_C), compiled with -std=c11 -Wall
            -Werror against engine/include, linked to the built libferry and
            run; `...` lines are elided code. A block of prototypes is
            compiled after <ferry.h> (a drifted signature conflicts); a
            ferry_ function must be declared there, any other must be
            checked by the fixture.
  cmake     a consumer project (tests/install/consumer.c as its source) with
            the block configured against an install of the build, built, run.
  output-of-previous   the previous block's commands' output (stdout and
            stderr) holds every shown line, in order.
  output-of [rc=N]: CMD    the same for CMD, run like an sh command.
  output-of-fixture: NAME  the same for a Python generator of real output
            (OUTPUT_FIXTURES: errors that need a set-up to happen).
            Output lines match whitespace-normalised; `...` alone on a line
            is a gap, `...` inside a line matches any text.
  trace     the lines are a ferry trace: `ferry sim --trace` and `ferry
            check --trace` must read them.
  usage-of: CMD   a synopsis: every flag in it is in `CMD --help`.
  paths     an illustration: every path it names exists in the repository.
  skip (reason)   not run; the reason names what runs it instead.

Every block runs in a fresh work dir that mirrors the repository root (its
entries as symlinks; `build/` a directory of links to the build's entries,
so outputs like build/demo stay in the work dir) holding t.jsonl (a tiny
synthesized trace), mine.lua (the README's policy) and train.py (a tiny
trainer), with the build's bin/ and `python`/`python3` (the torch
interpreter) first on PATH, PYTHONPATH the build's python/, FERRY_LIB the
built library.

Usage: run_docs.py --ferry BIN --lib LIBFERRY_SO --pythonpath DIR
                   --torch-python PY --build DIR [--only SUBSTRING]
Prints one line per block and ends with `N passed, M failed[, K skipped]`.
Exit 1 when a block failed (or a directive is malformed)."""
import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCS = ["README.md", "CONTRIBUTING.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TIMEOUT = 300

# ---------------------------------------------------------------- fixtures --
# Python fixtures: the names the docs' snippets use, bound to a tiny real
# torch model (no mocks). `torch` is always imported before them.
_LM = r'''
import torch.nn as nn
import torch.nn.functional as F
from types import SimpleNamespace
torch.manual_seed(0)

class _Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))

class TinyLM(nn.Module):
    """A causal LM shaped like Hugging Face's: model(**batch).loss, with
    model.embed_tokens, model.layers.N, model.norm and lm_head."""
    def __init__(self, vocab=128, d=64, n_layers=4):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(_Layer(d) for _ in range(n_layers))
        self.model.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                   labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)

model = TinyLM()
def _batch():
    ids = torch.randint(0, 128, (2, 32))
    return {"input_ids": ids, "labels": ids}
batch = _batch()
loader = [_batch() for _ in range(3)]
opt = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = 1000
'''

_MLP = r'''
import torch.nn as nn
torch.manual_seed(0)

class TinyMLP(nn.Module):
    """model.blocks.N and model.head; model(x) is a tensor."""
    def __init__(self, d=64, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

model = TinyMLP()
data = [(torch.randn(16, 64), torch.randn(16, 1)) for _ in range(3)]
loss_fn = nn.MSELoss()
'''

# DCP's async_save on one process (no process group: DCP saves locally).
_DCP = _LM + r'''
model_and_optim_state = {"model": model.state_dict(), "optim": opt.state_dict()}
'''

_LIGHTNING = r'''
import lightning
'''

# A tiny Llama built from a config (no download), a token data set and
# TrainingArguments for two CPU steps: what a Trainer snippet names.
_TRANSFORMERS = r'''
import tempfile
import transformers
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))

class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 96, (8, 16))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

ds = _Tokens()
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2,
                                      per_device_train_batch_size=2, report_to=[],
                                      use_cpu=True, save_strategy="no")
'''

FIXTURES = {"lm": _LM, "mlp": _MLP, "dcp": _DCP, "lightning": _LIGHTNING,
            "transformers": _TRANSFORMERS}

# train.py of the work dirs: what `ferry run ... -- python train.py` starts.
TRAIN_PY = '''"""The docs' train.py: a tiny LM trained two steps through
ferry.torch.offload with the defaults `ferry run` sets (FERRY_POLICY,
FERRY_TRACE, FERRY_CHROME_TRACE, FERRY_HOST_CAP, FERRY_BACKEND)."""
import sys
import torch
import ferry.torch
''' + _LM + '''
for _ in range(2):
    with ferry.torch.offload(model):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
ferry.torch.step()
s = ferry.torch.stats()
print("train.py: policy %s, %d tensors offloaded" % (s["policy"], s["tensors_offloaded"]))
sys.exit(0 if s["tensors_offloaded"] > 0 else 1)
'''

# Generators of real output that needs a set-up: their stdout is matched
# against the block. NAME -> (python code, normaliser of both sides).
_SNAPSHOT_ERRORS = r'''
import os, subprocess, sys, torch, ferry.torch
from ferry.checkpoint import CheckpointError
wd = os.getcwd()

def message(path):
    h = ferry.torch.snapshot({"w": torch.randn(1 << 20)}, path)  # 4 MiB; raises nothing:
    try:                                                          # I/O errors are the handle's
        h.wait()
    except CheckpointError as e:
        return str(e)
    return "snapshot %s: no error" % path

if sys.argv[1:] == ["full"]:     # inside the mount namespace, ckpt/ a 1 MiB tmpfs
    print(message(os.path.join(wd, "ckpt", "step-1000.pt")).replace(wd, ""))
    sys.exit(0)
os.mkdir("ckpt")
mount = "mount -t tmpfs -o size=1m tmpfs ckpt && exec \"$0\" \"$1\" full"
for unshare in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
    r = subprocess.run(unshare + ["sh", "-c", mount, sys.executable, sys.argv[0]],
                       capture_output=True, text=True)
    if r.returncode == 0:
        sys.stdout.write(r.stdout)
        break
else:
    print("SKIP: cannot mount a 1 MiB tmpfs in a mount namespace here (the disk-full line)")
    sys.exit(0)
print(message("/nonexistent/ckpt.pt"))
'''
OUTPUT_FIXTURES = {
    # the temporary file's random suffix (mkstemp's XXXXXX)
    "snapshot_errors": (_SNAPSHOT_ERRORS,
                        lambda s: re.sub(r"\.ferry-[A-Za-z0-9]{6}", ".ferry-XXXXXX", s)),
}

# C fixtures: declarations before main, and code run at the start of main.
_C_BUFFERS = r'''
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#define UNUSED __attribute__((unused))
/* Owner tokens: refcounted host buffers standing in for device memory. */
typedef struct buf { void *ptr; int refs; } buf;
static int live_bufs;
static UNUSED buf *buf_new(uint64_t bytes) {
  buf *b = malloc(sizeof *b);
  b->ptr = calloc(1, bytes ? bytes : 1);
  b->refs = 1;
  live_bufs++;
  return b;
}
static UNUSED void buf_drop(buf *b) {
  if (b && --b->refs == 0) { free(b->ptr); free(b); live_bufs--; }
}
static UNUSED int my_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  buf *b = buf_new(bytes);
  *ptr = b->ptr;
  *owner = b;
  return 0;
}
static UNUSED void my_release(void *ud, void *owner) { buf_drop(owner); }
static UNUSED void my_retain(void *ud, void *owner) { ((buf *)owner)->refs++; }
#define on_alloc my_alloc
#define on_release my_release
#define on_retain my_retain
static UNUSED struct { int unused; } my_allocator;
static UNUSED int my_decide(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                            ferry_decision *out) {
  memset(out, 0, sizeof *out);
  out->action = FERRY_OFFLOAD;
  return 0;
}
static UNUSED ferry_engine *host_engine(void) { /* the fixture's engine: host backend */
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.device_alloc = my_alloc;
  cfg.release = my_release;
  cfg.retain = my_retain;
  cfg.decide = my_decide;
  ferry_engine *e;
  char err[256];
  if (ferry_engine_create(&cfg, &e, err, sizeof err)) { fprintf(stderr, "fixture: %s\n", err); exit(2); }
  return e;
}
'''

FIXTURES_C = {
    # README's C API: my_alloc/my_release/my_retain, a descriptor and a buffer
    "callbacks": (_C_BUFFERS + r'''
static UNUSED ferry_tensor_desc desc = {.bytes = 4096, .dtype = FERRY_DTYPE_F32,
                                        .kind = FERRY_KIND_ACTIVATION,
                                 .ndim = 1, .shape = {1024}, .layer = 0, .layer_count = 1,
                                 .module_path = "model.layers.0.mlp", .module_class = "MLP"};
static UNUSED void *dev_ptr, *owner, *compute_stream;
static UNUSED ferry_handle handle;
''', "{ buf *b = buf_new(4096); dev_ptr = b->ptr; owner = b; }", ""),
    # embedding.md's loop over layers: x/y buffers, forward_layer makes y;
    # one pack is refused (as ferry_pack may be), which the block must
    # survive without losing or dropping that buffer
    "layers": (_C_BUFFERS + r'''
enum { L = 6, n = 4096 };
static const uint64_t bytes = n * sizeof(float);
static ferry_handle handle[L];
static UNUSED buf *saved[L];
static void *stream;
#define forward_layer(l, x, y, s) ((y) = buf_new(bytes))
#define backward_layer(l, p, s) ((void)(p))
#define drop_reference(o) buf_drop(o)
static UNUSED _Noreturn void stop_training(ferry_engine *e) {
  fprintf(stderr, "stop_training: %s\n", ferry_last_error(e));
  exit(1);
}
static int refuse_layer_2(ferry_engine *e, const ferry_tensor_desc *d, void *ptr, void *owner,
                          void *stream, ferry_handle *out) {
  if (d->layer == 2) return FERRY_ENOMEM; /* refused: nothing taken */
  return (ferry_pack)(e, d, ptr, owner, stream, out);
}
#define ferry_pack refuse_layer_2
''', "ferry_engine *e = host_engine(); buf *x = buf_new(bytes), *y = NULL;",
        # x (the last layer's output) is still the caller's; every other
        # buffer must have gone back through release or drop_reference
        "buf_drop(x); ferry_engine_destroy(e);"
        " if (live_bufs) { fprintf(stderr, \"%d buffers leaked\\n\", live_bufs); return 1; }"),
    # checkpoints.md's C API: records of host and device bytes
    "snapshot": (_C_BUFFERS + r'''
static char pickle[64] = "not a real pickle";
static const uint64_t pickle_len = sizeof pickle;
static float weight[1024], exp_avg[1024];
static const uint64_t weight_bytes = sizeof weight, exp_avg_bytes = sizeof exp_avg;
static void *compute_stream;
static void forward_and_backward(void) {}
static void optimizer_step(void) { weight[0] += 1; }
''', "ferry_engine *engine = host_engine(); mkdir(\"ckpt\", 0755);",
        "struct stat st; if (stat(\"ckpt/step-1000.pt\", &st) || st.st_size == 0) return 1;"
        " ferry_engine_destroy(engine);"),
    # prototypes of the embedder's callbacks must fit ferry_config's fields
    "config_callbacks": (r'''
static __attribute__((unused)) void check_callbacks(void) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.device_alloc = on_alloc;
  c.release = on_release;
  c.retain = on_retain;
  (void)c;
}
''', "", ""),
}


# ----------------------------------------------------------------- parsing --
class Block:
    def __init__(self, path, line, lang, body, directive, directive_line):
        self.path, self.line, self.lang, self.body = path, line, lang, body
        self.directive, self.directive_line = directive, directive_line
        self.where = f"{path}:{line}"
        self.outputs = None  # commands' output, for output-of-previous


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([A-Za-z0-9_+-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")


def extract(path):
    """Every fenced block of path, with the directive on the line before it;
    errors for unclosed fences and directives not followed by a fence."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    blocks, errors, i = [], [], 0
    used_directives = set()
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*" + re.escape(fence[0]) + "{%d,}\\s*$" % len(fence),
                                              lines[j]):
            j += 1
        if j == len(lines):
            errors.append(f"{path}:{i + 1}: fence never closed")
            break
        body = "\n".join(l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:j])
        d = DIRECTIVE.match(lines[i - 1]) if i > 0 else None
        if d:
            used_directives.add(i - 1)
        blocks.append(Block(path, i + 1, lang, body, d.group(1).strip() if d else None, i))
        i = j + 1
    for k, l in enumerate(lines):
        if DIRECTIVE.match(l) and k not in used_directives:
            errors.append(f"{path}:{k + 1}: a doc-test directive not on the line just before a fence")
        elif l.lstrip().startswith("<!--") and "doc-test" in l and not DIRECTIVE.match(l):
            errors.append(f"{path}:{k + 1}: malformed doc-test directive: {l.strip()}")
    return blocks, errors


class DirectiveError(Exception):
    pass


MODES = {"sh", "python", "lua", "c", "cmake", "output-of-previous", "output-of",
         "output-of-fixture", "trace", "usage-of", "paths", "skip"}
OPTIONS = {"sh": {"except", "swap", "ctest", "needs", "creates"},
           "python": {"fixture", "import", "creates", "torch"},
           "lua": {"save-as", "expect"},
           "c": {"fixture"},
           "output-of": {"rc"}}


def parse_directive(block):
    """(mode, options, reason, argument) of a block."""
    text = block.directive
    if text is None:
        default = {"sh": "sh", "bash": "sh", "shell": "sh", "python": "python", "lua": "lua",
                   "c": "c", "cmake": "cmake"}.get(block.lang)
        if not default:
            raise DirectiveError(f"a block labelled {block.lang or '(none)'!r} needs a doc-test "
                                 "directive saying what it is (see tests/docs/run_docs.py)")
        return default, {}, None, None
    reason = None
    m = re.search(r"\((.*)\)\s*$", text)
    if m and not text.startswith(("output-of", "usage-of")):
        reason = m.group(1).strip()
        text = text[:m.start()].strip()
    arg = None
    if re.match(r"^(output-of|output-of-fixture|usage-of)\b[^:]*:", text):
        head, arg = text.split(":", 1)
        text, arg = head.strip(), arg.strip()
    words = text.split()
    if not words:
        raise DirectiveError("empty doc-test directive")
    mode, opts = words[0], {}
    if mode not in MODES:
        raise DirectiveError(f"unknown doc-test mode {mode!r} (one of {', '.join(sorted(MODES))})")
    for w in words[1:]:
        if "=" not in w:
            raise DirectiveError(f"doc-test option {w!r} is not key=value")
        k, v = w.split("=", 1)
        if k not in OPTIONS.get(mode, set()):
            raise DirectiveError(f"unknown option {k!r} for doc-test mode {mode}")
        opts[k] = v
    if mode == "skip" and not reason:
        raise DirectiveError("a doc-test skip needs a reason in parentheses: what runs it instead")
    if ("except" in opts or "swap" in opts or "torch" in opts) and not reason:
        raise DirectiveError("except=, swap= and torch= need a reason in parentheses")
    if mode in ("output-of", "output-of-fixture", "usage-of") and not arg:
        raise DirectiveError(f"{mode} needs ': COMMAND' (or ': NAME')")
    if block.lang and mode in ("output-of-previous", "output-of", "output-of-fixture", "trace",
                               "paths") and block.lang not in ("text", "console", "jsonl", "json"):
        raise DirectiveError(f"mode {mode} is for unlabelled blocks, this one is {block.lang!r}")
    return mode, opts, reason, arg


# ------------------------------------------------------------------ running --
# Commands that would configure, rebuild or pip-install the build this test
# runs on (through the work dir's links): refused, so that a new doc block
# cannot damage the build; the docs mark them except= or skip.
UNSAFE = re.compile(r"(^|[;&|(]\s*)(cmake\s+(-S|-B|--build)\b|make\b|pip\s+install\b|"
                    r"python3?\s+-m\s+(pip|build)\b)")


class Skip(Exception):
    pass


class Fail(Exception):
    pass


def tail(text, n=2500):
    text = text or ""
    return text if len(text) <= n else "...\n" + text[-n:]


class Runner:
    def __init__(self, a):
        self.a = a
        self.ferry = os.path.abspath(a.ferry)
        self.lib = os.path.abspath(a.lib)
        self.build = os.path.abspath(a.build)
        self.top = tempfile.mkdtemp(prefix="ferry-docs-")
        self.saved = {"train.py": TRAIN_PY}
        self.prefix = None
        # torch 2.x: $FERRY_DOCS_TORCH2, else the venv .ci/python-env keeps
        # once it is complete (its stamp written) and imports a torch 2.x
        self.torch2 = os.environ.get("FERRY_DOCS_TORCH2") or None
        venv = os.environ.get("FERRY_VENV") or os.path.expanduser("~/.cache/ferry/venv-torch2")
        if not self.torch2 and os.path.exists(os.path.join(venv, ".ferry-requirements")):
            py = os.path.join(venv, "bin", "python")
            probe = "import sys, torch; sys.exit(int(torch.__version__.split('.')[0]) < 2)"
            if subprocess.run([py, "-c", probe], capture_output=True).returncode == 0:
                self.torch2 = py
        shim = os.path.join(self.top, "bin")
        os.mkdir(shim)
        for name in ("python", "python3"):
            os.symlink(a.torch_python, os.path.join(shim, name))
        self.env = dict(os.environ)
        self.env.update({
            "PATH": os.pathsep.join([shim, os.path.dirname(self.ferry), os.environ.get("PATH", "")]),
            "PYTHONPATH": os.path.abspath(a.pythonpath),
            "FERRY_LIB": self.lib,
            "NO_COLOR": "1",
            "MANPAGER": "cat", "PAGER": "cat",
        })
        self.env.pop("FERRY_POLICY", None)
        tiny = os.path.join(self.top, "t.jsonl")
        self.check_run([self.ferry, "trace", "synth", "--preset", "tiny", "-o", tiny], self.top)
        with open(tiny) as f:
            self.saved["t.jsonl"] = f.read()
        self.n = 0

    def workdir(self):
        """A fresh directory that looks like the repository root."""
        self.n += 1
        wd = os.path.join(self.top, "wd%02d" % self.n)
        os.mkdir(wd)
        for name in os.listdir(ROOT):
            full = os.path.join(ROOT, name)
            # build trees (build/, build-asan/...) are outputs: the one under
            # test is laid out below as build/
            if name == ".git" or name.startswith("build") or \
                    os.path.realpath(full) == os.path.realpath(self.build):
                continue
            os.symlink(full, os.path.join(wd, name))
        os.mkdir(os.path.join(wd, "build"))
        for name in os.listdir(self.build):
            if name != "demo":
                os.symlink(os.path.join(self.build, name), os.path.join(wd, "build", name))
        for name, text in self.saved.items():
            with open(os.path.join(wd, name), "w") as f:
                f.write(text)
        os.mkdir(os.path.join(wd, ".cache"))
        return wd

    def envfor(self, wd, **extra):
        env = dict(self.env, XDG_CACHE_HOME=os.path.join(wd, ".cache"))
        env.update(extra)
        return env

    def check_run(self, cmd, cwd, env=None, timeout=TIMEOUT, what=None, shell=False, rc=0):
        try:
            r = subprocess.run(cmd, cwd=cwd, env=env or self.env, capture_output=True, text=True,
                               timeout=timeout, shell=shell, executable="/bin/bash" if shell else None)
        except subprocess.TimeoutExpired:
            raise Fail(f"{what or cmd}: timed out after {timeout} s")
        out = r.stdout + r.stderr
        if rc is not None and r.returncode != rc:
            raise Fail(f"{what or cmd}: exit {r.returncode}" + (f", want {rc}" if rc else "")
                       + f"\n{tail(out)}")
        return r, out

    # -- sh --
    @staticmethod
    def commands(body):
        """(first line in the block, command) with continuation lines joined
        and comment-only lines dropped."""
        out, cur, start = [], "", None
        for k, line in enumerate(body.split("\n"), 1):
            if not cur and (not line.strip() or line.strip().startswith("#")):
                continue
            if start is None:
                start = k
            cur += line
            if line.rstrip().endswith("\\"):
                cur = cur.rstrip()[:-1] + " "
                continue
            out.append((start, cur.strip()))
            cur, start = "", None
        if cur:
            out.append((start, cur.strip()))
        return out

    def run_sh(self, b, opts, reason, wd=None):
        for prog in filter(None, opts.get("needs", "").split(",")):
            if "/" in prog:  # a file of the repository or (build/...) of the build
                full = os.path.join(self.build, prog[6:]) if prog.startswith("build/") else \
                    os.path.join(ROOT, prog)
                if not os.path.exists(full):
                    raise Skip(f"{prog} is not built here ({reason})")
            elif not shutil.which(prog, path=self.env["PATH"]):
                raise Skip(f"{prog} is not installed here")
        wd = wd or self.workdir()
        skip_lines = {int(x) for x in opts.get("except", "").split(",") if x}
        cmds = self.commands(b.body)
        ran, outputs = 0, []
        for start, cmd in cmds:
            if start in skip_lines:
                continue
            if "swap" in opts:
                for pair in opts["swap"].split(","):
                    old, new = pair.split(":", 1)
                    cmd = cmd.replace(old, new)
            listing = opts.get("ctest") == "list" and cmd.startswith("ctest ")
            if UNSAFE.search(cmd) or (cmd.startswith("ctest") and not listing):
                raise Fail(f"line {start}: {cmd}: would rebuild, install or run the build under "
                           "test (the work dir's build/ links to it): mark it except= or skip, "
                           "with a reason")
            if listing:  # -N right after `ctest`: the line may end in a comment
                cmd = "ctest -N" + cmd[len("ctest"):]
            r, out = self.check_run(["bash", "-o", "pipefail", "-c", cmd], wd, self.envfor(wd),
                                    what=f"line {start}: {cmd}")
            outputs.append(out)
            if listing:
                m = re.search(r"Total Tests: (\d+)", out)
                if not m or int(m.group(1)) == 0:
                    raise Fail(f"line {start}: {cmd}: selects no test\n{tail(out)}")
            if re.search(r"\|\s*jq\b[^|]*$", cmd) and re.search(r"^null$", r.stdout, re.M):
                raise Fail(f"line {start}: {cmd}: jq printed null: the JSON has no such field\n"
                           f"{tail(r.stdout)}")
            ran += 1
        if ran == 0:
            raise Fail("no command left to run (use skip with a reason instead)")
        self.check_creates(wd, opts)
        b.outputs = "\n".join(outputs)
        return f"{ran} command(s)" + (f"; lines {opts['except']} not run" if skip_lines else "")

    def check_creates(self, wd, opts):
        for pattern in filter(None, opts.get("creates", "").split(",")):
            if not glob.glob(os.path.join(wd, pattern)):
                raise Fail(f"made no {pattern}")

    # -- python --
    def run_python(self, b, opts, reason):
        py = self.a.torch_python
        if opts.get("torch") == "2":
            if not self.torch2:
                msg = (f"no torch 2.x interpreter (FERRY_DOCS_TORCH2 unset, no venv from "
                       f".ci/python-env): {reason}")
                if os.environ.get("CI") == "true":
                    raise Fail("under CI every block must run: " + msg)
                raise Skip(msg)
            py = self.torch2
        wd = self.workdir()
        fixtures = [f for f in opts.get("fixture", "").split(",") if f]
        for f in fixtures:
            if f not in FIXTURES:
                raise Fail(f"unknown python fixture {f!r} (one of {', '.join(FIXTURES)})")
        prelude = "import torch\n" + "".join(FIXTURES[f] for f in fixtures)
        prelude += "".join(f"import {m}\n" for m in opts.get("import", "").split(",") if m)
        with open(os.path.join(wd, "doc_block.py"), "w") as f:
            f.write(prelude + "\n# ---- the doc block ----\n" + b.body + "\n")
        self.check_run([py, "doc_block.py"], wd, self.envfor(wd), what="python")
        self.check_creates(wd, opts)
        return f"torch 2.x: {py}" if py != self.a.torch_python else ""

    # -- lua --
    @staticmethod
    def lua_items(body):
        """The top-level items of a rules-library fragment: each call or
        `field = value`, across lines while brackets are open."""
        items, cur, depth = [], [], 0
        for line in body.split("\n"):
            code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', '""', line)
            code = code.split("--", 1)[0]
            if not code.strip() and depth == 0:
                continue
            cur.append(line)
            depth += sum(code.count(c) for c in "({[") - sum(code.count(c) for c in ")}]")
            if depth == 0:
                items.append("\n".join(cur))
                cur = []
        if cur:
            items.append("\n".join(cur))
        return items

    def ferry_check(self, wd, path, what):
        r, out = self.check_run([self.ferry, "check", "-q", path], wd, self.envfor(wd), what=what)
        if not re.search(r"\b0 faults\b", out):
            raise Fail(f"{what}: faults\n{tail(out)}")

    def run_lua(self, b, opts, reason):
        wd = self.workdir()
        if re.search(r"""require\s*\(?\s*["']ferry["']""", b.body):
            with open(os.path.join(wd, "doc_block.lua"), "w") as f:
                f.write(b.body + "\n")
            env = self.envfor(wd, LUA_PATH="bindings/lua/?.lua;;")
            r, out = self.check_run(["luajit", "doc_block.lua"], wd, env, what="luajit")
            if "expect" in opts:
                last = (r.stdout.strip().split("\n") or [""])[-1].strip()
                if last != opts["expect"]:
                    raise Fail(f"printed {last!r}, the doc says {opts['expect']!r}\n{tail(out)}")
            return "luajit FFI script"
        if re.search(r"^\s*return\b", b.body, re.M):
            with open(os.path.join(wd, "doc_policy.lua"), "w") as f:
                f.write(b.body + "\n")
            self.ferry_check(wd, "doc_policy.lua", "ferry check")
            if "save-as" in opts:
                self.saved[opts["save-as"]] = b.body + "\n"
            return "policy, ferry check"
        items = self.lua_items(b.body)
        for k, item in enumerate(items, 1):
            name = os.path.join(wd, "doc_fragment_%d.lua" % k)
            with open(name, "w") as f:
                f.write('local R = require "ferry.rules"\nreturn R.policy {\n  name = "doc_fragment",\n'
                        + item + "\n}\n")
            self.ferry_check(wd, name, f"ferry check on R.policy {{ {item.strip()} }}")
        return f"{len(items)} fragment item(s), ferry check each"

    # -- c --
    PROTO = re.compile(r"^\s*(?:const\s+)?[A-Za-z_]\w*[\s*]+\**\s*([A-Za-z_]\w*)\s*\([^;{}]*\)\s*;")

    def run_c(self, b, opts, reason):
        wd = self.workdir()
        fx = opts.get("fixture")
        if fx and fx not in FIXTURES_C:
            raise Fail(f"unknown C fixture {fx!r} (one of {', '.join(FIXTURES_C)})")
        decls, setup, epilogue = FIXTURES_C[fx] if fx else ("", "", "")
        body = re.sub(r"/\*.*?\*/", "", b.body, flags=re.S)
        stmts = [l for l in body.split("\n") if l.strip() and not l.strip().startswith("//")]
        header = open(os.path.join(ROOT, "engine", "include", "ferry.h")).read()
        cc = os.environ.get("CC", "cc")
        flags = ["-std=c11", "-Wall", "-Werror", "-I", os.path.join(ROOT, "engine", "include")]
        if stmts and all(self.PROTO.match(l) for l in stmts):
            names = [self.PROTO.match(l).group(1) for l in stmts]
            for name in names:
                if name.startswith("ferry_"):
                    if not re.search(r"\b%s\s*\(" % name, header):
                        raise Fail(f"{name} is not declared in ferry.h")
                elif name not in decls:
                    raise Fail(f"{name} is not in ferry.h and no fixture checks its signature")
            with open(os.path.join(wd, "doc_block.c"), "w") as f:
                f.write("#include <ferry.h>\n" + b.body + "\n" + decls)
            self.check_run([cc, *flags, "-c", "doc_block.c"], wd, what="cc (prototypes)")
            return f"{len(names)} prototype(s) against ferry.h"
        includes = [l for l in b.body.split("\n") if l.startswith("#include")]
        code = "\n".join("  /* ... */" if l.strip() == "..." else "  " + l
                         for l in b.body.split("\n") if not l.startswith("#include"))
        src = ("#include <ferry.h>\n#include <stdio.h>\n#include <stdlib.h>\n" + "\n".join(includes)
               + "\n" + decls + "\nint main(void) {\n  " + setup + "\n  {\n" + code + "\n  }\n  "
               + epilogue + "\n  return 0;\n}\n")
        with open(os.path.join(wd, "doc_block.c"), "w") as f:
            f.write(src)
        libdir = os.path.dirname(self.lib)
        self.check_run([cc, *flags, "-o", "doc_block", "doc_block.c", self.lib,
                        "-Wl,-rpath," + libdir], wd, what="cc")
        r, out = self.check_run(["./doc_block"], wd, self.envfor(wd), what="the compiled block")
        note = out.strip().split("\n")[-1] if out.strip() else ""
        return "compiled and ran" + (f" ({note[:100]})" if note else "")

    # -- cmake --
    def run_cmake(self, b, opts, reason):
        wd = self.workdir()
        if not self.prefix:
            self.prefix = os.path.join(self.top, "prefix")
            self.check_run(["cmake", "--install", self.build, "--prefix", self.prefix], self.top,
                           what="cmake --install of the build")
        proj = os.path.join(wd, "consumer")
        os.mkdir(proj)
        shutil.copy(os.path.join(ROOT, "tests", "install", "consumer.c"),
                    os.path.join(proj, "trainer.c"))
        with open(os.path.join(proj, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.20)\nproject(doc_consumer LANGUAGES C)\n"
                    "add_executable(trainer trainer.c)\n" + b.body + "\n")
        out_dir = os.path.join(wd, "consumer-build")
        self.check_run(["cmake", "-S", proj, "-B", out_dir, "-DCMAKE_PREFIX_PATH=" + self.prefix],
                       wd, what="cmake configure")
        self.check_run(["cmake", "--build", out_dir], wd, what="cmake --build")
        r, out = self.check_run([os.path.join(out_dir, "trainer")], wd, what="the consumer")
        return out.strip()[:100]

    # -- output --
    @staticmethod
    def match(shown, real, norm=lambda s: s):
        """Every shown line (whitespace-normalised; `...` a gap or, inside a
        line, any text) is a line of real, in order."""
        ws = lambda s: " ".join(s.split())
        real_lines = [ws(norm(l)) for l in real.split("\n")]
        pos = 0
        for line in shown.split("\n"):
            s = ws(norm(line))
            if not s or s == "...":
                continue
            rx = re.compile(".*".join(re.escape(p) for p in s.split("...")))
            for k in range(pos, len(real_lines)):
                if rx.fullmatch(real_lines[k]):
                    pos = k + 1
                    break
            else:
                near = [l for l in real_lines if l and l.split()[0] == s.split()[0]][:3]
                raise Fail(f"the real output has no line (in order) like:\n    {s}\n"
                           + ("  nearest:\n" + "\n".join("    " + l for l in near) if near
                              else "  real output:\n" + tail(real, 1500)))

    def run_output(self, b, mode, opts, arg, prev):
        if mode == "output-of-previous":
            if prev is None or prev.outputs is None:
                raise Skip("the previous block did not run") if prev and prev.skipped else \
                    Fail("output-of-previous: the previous block is not a command block that ran")
            self.match(b.body, prev.outputs)
            return f"output of {prev.where}"
        wd = self.workdir()
        if mode == "output-of":
            if UNSAFE.search(arg) or arg.startswith("ctest"):
                raise Fail(f"{arg}: would rebuild, install or run the build under test")
            r, out = self.check_run(["bash", "-o", "pipefail", "-c", arg], wd, self.envfor(wd), what=arg,
                                    rc=int(opts.get("rc", 0)))
            self.match(b.body, out)
            return f"output of `{arg[:60]}`"
        if arg not in OUTPUT_FIXTURES:
            raise Fail(f"unknown output fixture {arg!r}")
        code, norm = OUTPUT_FIXTURES[arg]
        with open(os.path.join(wd, "doc_output.py"), "w") as f:
            f.write(code)
        r, out = self.check_run([self.a.torch_python, "doc_output.py"], wd, self.envfor(wd), what=arg)
        if r.stdout.startswith("SKIP: "):
            raise Skip(r.stdout.strip()[6:])
        self.match(b.body, r.stdout, norm)
        return f"output of fixture {arg}"

    def run_trace(self, b):
        wd = self.workdir()
        with open(os.path.join(wd, "doc_trace.jsonl"), "w") as f:
            f.write(b.body + "\n")
        self.check_run([self.ferry, "sim", "-q", "--trace", "doc_trace.jsonl", "--policy", "default"],
                       wd, self.envfor(wd), what="ferry sim --trace")
        self.check_run([self.ferry, "check", "-q", "--trace", "doc_trace.jsonl", "default"], wd,
                       self.envfor(wd), what="ferry check --trace")
        return "read by ferry sim --trace and ferry check --trace"

    def run_usage(self, b, arg):
        r, out = self.check_run(shlex.split(arg) + ["--help"], self.top, what=f"{arg} --help")
        flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", b.body.split(" -- ")[0]))
        flags -= {"--"}
        missing = sorted(f for f in flags
                         if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(f), r.stdout))
        if missing:
            raise Fail(f"not in `{arg} --help`: {', '.join(missing)}")
        return f"{len(flags)} flag(s) in `{arg} --help`"

    def run_paths(self, b):
        tokens = re.findall(r"[\w.-]+(?:/[\w.{},-]*)+", b.body)
        checked = 0
        for t in tokens:
            expanded = [t]
            m = re.search(r"\{([^}]*)\}", t)
            if m:
                expanded = [t[:m.start()] + alt + t[m.end():] for alt in m.group(1).split(",")]
            for p in expanded:
                if not any(os.path.exists(os.path.join(ROOT, base, p)) for base in ("", "engine/src")):
                    raise Fail(f"names {p}, which is not in the repository")
                checked += 1
        if not checked:
            raise Fail("names no path: use skip with a reason")
        return f"{checked} path(s) exist"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ferry", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--pythonpath", required=True)
    ap.add_argument("--torch-python", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--only", help="run only the blocks whose file:line contains this")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs")
    a = ap.parse_args()

    blocks, errors = [], []
    for path in DOCS:
        bs, es = extract(path)
        blocks += bs
        errors += es
    runner = Runner(a)
    passed = failed = skipped = 0
    counts = {}
    start = time.time()
    for e in errors:
        print(f"FAIL {e}")
        failed += 1
    prev_by_file = {}
    for b in blocks:
        prev = prev_by_file.get(b.path)
        prev_by_file[b.path] = b
        b.skipped = False
        if a.only and a.only not in b.where:
            continue
        t0 = time.time()
        try:
            mode, opts, reason, arg = parse_directive(b)
        except DirectiveError as e:
            print(f"FAIL {b.where:28} {b.lang or '-':7} {e}")
            failed += 1
            continue
        try:
            if mode == "skip":
                raise Skip(reason)
            elif mode == "sh":
                note = runner.run_sh(b, opts, reason)
            elif mode == "python":
                note = runner.run_python(b, opts, reason)
            elif mode == "lua":
                note = runner.run_lua(b, opts, reason)
            elif mode == "c":
                note = runner.run_c(b, opts, reason)
            elif mode == "cmake":
                note = runner.run_cmake(b, opts, reason)
            elif mode.startswith("output-of"):
                note = runner.run_output(b, mode, opts, arg, prev)
            elif mode == "trace":
                note = runner.run_trace(b)
            elif mode == "usage-of":
                note = runner.run_usage(b, arg)
            else:
                note = runner.run_paths(b)
            if reason and mode not in ("skip",):
                note = f"{note}; {reason}" if note else reason
            took = f"ran ({time.time() - t0:.1f} s)"
            print(f"ok   {b.where:28} {mode:18} {took}{': ' + note if note else ''}")
            passed += 1
            key = (mode, "ran")
        except Skip as e:
            b.skipped = True
            print(f"SKIP {b.where:28} {mode:18} skipped: {e}")
            skipped += 1
            key = (mode, "skipped")
        except Fail as e:
            msg = str(e).replace("\n", "\n     ")
            print(f"FAIL {b.where:28} {mode:18} {msg}")
            failed += 1
            key = (mode, "failed")
        counts[key] = counts.get(key, 0) + 1
        sys.stdout.flush()
    if not a.keep:
        shutil.rmtree(runner.top, ignore_errors=True)
    else:
        print(f"work dirs kept in {runner.top}")
    print(f"\n{len(blocks)} fenced blocks in {len(DOCS)} files, {time.time() - start:.0f} s; by mode: "
          + ", ".join(f"{m} {k} {n}" for (m, k), n in sorted(counts.items())))
    if not blocks:
        failed += 1
        print("FAIL no fenced block found")
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
