"""Offline checks of the Terraform in infra/ (no terraform binary, no AWS account).

Every .tf file is parsed with the pinned python-hcl2 and the properties the design depends on
are asserted by checker functions. Each checker returns a list of problems (empty = fine), so
the same function is run on the real configuration and on small broken snippets that it must
catch: a check that cannot fail proves nothing.

Run: infra/check (or python -m unittest discover -s infra/tests with python-hcl2 installed).
"""

import json
import re
import unittest
from pathlib import Path

import hcl2
from hcl2.utils import SerializationOptions

INFRA = Path(__file__).resolve().parents[1]
REPO = INFRA.parent
MODULE_SOURCE = "./modules/region"
OPTIONS = SerializationOptions(
    with_comments=False, explicit_blocks=False, preserve_heredocs=False, strip_string_quotes=True
)


# ---- loading -------------------------------------------------------------------------------


class Config:
    """One Terraform module: the blocks of all its .tf files."""

    def __init__(self, docs):
        self.docs = docs  # {file name: parsed dict}

    def _labelled(self, kind, depth):
        out = []
        for fname, doc in self.docs.items():
            for item in doc.get(kind, []):
                if depth == 2:
                    for rtype, named in item.items():
                        for name, body in named.items():
                            out.append((fname, rtype, name, body))
                else:
                    for name, body in item.items():
                        out.append((fname, None, name, body))
        return out

    @property
    def resources(self):
        return self._labelled("resource", 2)

    @property
    def data(self):
        return self._labelled("data", 2)

    @property
    def modules(self):
        return self._labelled("module", 1)

    @property
    def variables(self):
        return {name: body for _, _, name, body in self._labelled("variable", 1)}

    @property
    def outputs(self):
        return self._labelled("output", 1)

    @property
    def providers(self):
        return self._labelled("provider", 1)

    @property
    def locals(self):
        out = {}
        for doc in self.docs.values():
            for item in doc.get("locals", []):
                out.update(item)
        return out

    @property
    def terraform(self):
        return [t for doc in self.docs.values() for t in doc.get("terraform", [])]

    def of_type(self, rtype):
        return [(f, n, b) for f, t, n, b in self.resources if t == rtype]


def load_dir(path):
    return Config({p.name: hcl2.load(p.open(), serialization_options=OPTIONS) for p in sorted(Path(path).glob("*.tf"))})


def from_text(text):
    return Config({"snippet.tf": hcl2.loads(text, serialization_options=OPTIONS)})


def blocks(body, name):
    """A nested block (or repeated blocks) as a list of dicts."""
    value = body.get(name, [])
    if isinstance(value, dict):
        return [value]
    return [v for v in value if isinstance(v, dict)]


def expr(value):
    """The text of an expression: `${aws.dr}` -> `aws.dr`; literals unchanged."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value[2:-1]
    return value


def walk(value, path=""):
    """Every (path, key, value) of attributes, nested blocks included."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, f"{path}[{i}]")


def words(label):
    return set(re.split(r"[_\-]", label.lower()))


def expected_region(label, rtype=None):
    """Naming rule of the root module: a `dr` word means the DR Region; a replicator lives in
    its target Region (the DR one)."""
    return "dr" if "dr" in words(label) or rtype == "aws_msk_replicator" else "primary"


# ---- checkers ------------------------------------------------------------------------------


def check_root_providers(root):
    problems = []
    aws = [(n, b) for _, _, n, b in root.providers if n == "aws"]
    aliases = {b.get("alias"): expr(b.get("region")) for _, b in aws}
    if None in aliases:
        problems.append("an aws provider without alias: resources could land in it silently")
    if aliases.get("primary") != "var.primary_region" or aliases.get("dr") != "var.dr_region":
        problems.append(f"expected aws.primary in var.primary_region and aws.dr in var.dr_region, got {aliases}")
    for kind, items in (("resource", root.resources), ("data", root.data)):
        for f, rtype, name, body in items:
            if not rtype.startswith("aws_"):
                continue
            want = f"aws.{expected_region(name, rtype)}"
            got = expr(body.get("provider"))
            if got != want:
                problems.append(f"{f}: {kind} {rtype}.{name} uses provider {got!r}, want {want}")
    regions = set()
    for f, _, name, body in root.modules:
        want = f"aws.{expected_region(name)}"
        got = expr((body.get("providers") or {}).get("aws"))
        if got != want:
            problems.append(f"{f}: module {name} gets aws = {got!r}, want {want}")
        if body.get("source") == MODULE_SOURCE:
            regions.add(got)
    if regions != {"aws.primary", "aws.dr"}:
        problems.append(f"the region module must be instantiated once per Region, got {sorted(map(str, regions))}")
    return problems


def check_inherits_region(cfg, is_root):
    """Nothing may pick a Region behind the provider's back: the module names no provider and
    no resource sets the AWS provider v6 per-resource `region` argument."""
    problems = []
    for f, rtype, name, body in cfg.resources + cfg.data:
        if "region" in body:
            problems.append(f"{f}: {rtype}.{name} sets region = {body['region']!r} (use the provider)")
        if not is_root and "provider" in body:
            problems.append(f"{f}: {rtype}.{name} sets provider inside the module")
    if not is_root:
        if cfg.providers:
            problems.append("the module configures a provider of its own")
        for t in cfg.terraform:
            for rp in blocks(t, "required_providers"):
                if "configuration_aliases" in json.dumps(rp):
                    problems.append("the module declares provider configuration aliases")
    return problems


def check_ecs_private(cfg):
    problems = []
    services = cfg.of_type("aws_ecs_service")
    for f, name, body in services:
        nets = blocks(body, "network_configuration")
        if not nets:
            problems.append(f"{f}: aws_ecs_service.{name} has no network_configuration")
        for net in nets:
            if net.get("assign_public_ip") is not False:
                problems.append(f"{f}: aws_ecs_service.{name} assign_public_ip is {net.get('assign_public_ip')!r}, want false")
            subnets = str(net.get("subnets"))
            if "private" not in subnets or "public" in subnets:
                problems.append(f"{f}: aws_ecs_service.{name} runs in {subnets}, want the private subnets")
    return problems


def check_private_placement(cfg):
    problems = []
    for f, name, body in cfg.of_type("aws_subnet"):
        if body.get("map_public_ip_on_launch") is True:
            problems.append(f"{f}: aws_subnet.{name} gives public IPs on launch")
    placed = [
        ("aws_db_subnet_group", lambda b: b.get("subnet_ids")),
        ("aws_elasticache_subnet_group", lambda b: b.get("subnet_ids")),
        ("aws_msk_cluster", lambda b: [g.get("client_subnets") for g in blocks(b, "broker_node_group_info")]),
    ]
    for rtype, get in placed:
        for f, name, body in cfg.of_type(rtype):
            where = str(get(body))
            if "private" not in where or "public" in where:
                problems.append(f"{f}: {rtype}.{name} is placed in {where}, want the private subnets")
    for f, name, body in cfg.of_type("aws_msk_cluster"):
        for g in blocks(body, "broker_node_group_info"):
            for c in blocks(g, "connectivity_info"):
                for pa in blocks(c, "public_access"):
                    if pa.get("type") != "DISABLED":
                        problems.append(f"{f}: aws_msk_cluster.{name} public access {pa.get('type')!r}")
    for f, name, body in cfg.of_type("aws_rds_cluster_instance"):
        if body.get("publicly_accessible") is not False:
            problems.append(f"{f}: aws_rds_cluster_instance.{name} publicly_accessible is not false")
    return problems


class Resolver:
    """Concrete values of an attribute of the region module: `var.X` is followed into every
    module call of the root and from there to the root variable's default."""

    def __init__(self, root, module):
        self.root, self.module = root, module
        self.calls = [b for _, _, _, b in root.modules if b.get("source") == MODULE_SOURCE]

    def values(self, value, in_module=True):
        e = expr(value)
        if not isinstance(e, str):
            return [e], []
        m = re.fullmatch(r"var\.(\w+)", e)
        if not m:
            return [], [f"cannot resolve {value!r}"]
        name = m.group(1)
        scope = self.module if in_module else self.root
        var = scope.variables.get(name)
        if var is None:
            return [], [f"no variable {name}"]
        chain = [(name, var)]
        if in_module and self.calls:
            out, problems = [], []
            for call in self.calls:
                v, p = self.values(call[name], in_module=False) if name in call else ([var.get("default")], [])
                out += v
                problems += p
            return out, problems + self._validated(chain)
        return [var.get("default")], self._validated(chain)

    @staticmethod
    def _validated(chain):
        problems = []
        for name, var in chain:
            conds = " ".join(str(v.get("condition")) for v in blocks(var, "validation"))
            if "% 3 == 0" not in conds:
                problems.append(f"variable {name} has no validation that it is a multiple of 3")
        return problems


def server_properties(text):
    props = {}
    for line in str(text).splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            props[k.strip()] = v.strip()
    return props


def check_msk(cfg, resolver=None):
    problems = []
    clusters = cfg.of_type("aws_msk_cluster")
    configurations = cfg.of_type("aws_msk_configuration")
    if not clusters or not configurations:
        problems.append("no aws_msk_cluster with an aws_msk_configuration")
    for f, name, body in configurations:
        props = server_properties(body.get("server_properties"))
        for key, want in (
            ("min.insync.replicas", "2"),
            ("unclean.leader.election.enable", "false"),
            ("default.replication.factor", "3"),
        ):
            if props.get(key) != want:
                problems.append(f"{f}: aws_msk_configuration.{name} {key}={props.get(key)!r}, want {want}")
    for f, name, body in clusters:
        raw = body.get("number_of_broker_nodes")
        counts, p = resolver.values(raw) if resolver else ([expr(raw)], [])
        problems += [f"{f}: aws_msk_cluster.{name} brokers: {x}" for x in p]
        for n in counts:
            if not isinstance(n, int) or n < 3 or n % 3:
                problems.append(f"{f}: aws_msk_cluster.{name} has {n!r} brokers, want a multiple of 3")
        enc = blocks(body, "encryption_info")
        transit = [t for e in enc for t in blocks(e, "encryption_in_transit")]
        if not enc or not enc[0].get("encryption_at_rest_kms_key_arn"):
            problems.append(f"{f}: aws_msk_cluster.{name} has no KMS key for encryption at rest")
        if not transit or transit[0].get("client_broker") != "TLS" or transit[0].get("in_cluster") is not True:
            problems.append(f"{f}: aws_msk_cluster.{name} is not TLS-only in transit (client_broker TLS, in_cluster true)")
        auth = blocks(body, "client_authentication")
        if not auth or auth[0].get("unauthenticated") is not False:
            problems.append(f"{f}: aws_msk_cluster.{name} must set client_authentication.unauthenticated = false")
        conf = [c.get("arn") for c in blocks(body, "configuration_info")]
        if not conf or "aws_msk_configuration." not in str(conf[0]):
            problems.append(f"{f}: aws_msk_cluster.{name} does not use an aws_msk_configuration")
    return problems


def check_aurora(cfg):
    problems = []
    for f, name, body in cfg.of_type("aws_rds_global_cluster"):
        for attr in ("storage_encrypted", "deletion_protection"):
            if body.get(attr) is not True:
                problems.append(f"{f}: aws_rds_global_cluster.{name} {attr} is not true")
    for f, name, body in cfg.of_type("aws_rds_cluster"):
        for attr in ("storage_encrypted", "deletion_protection"):
            if body.get(attr) is not True:
                problems.append(f"{f}: aws_rds_cluster.{name} {attr} is not true")
        if not body.get("kms_key_id"):
            problems.append(f"{f}: aws_rds_cluster.{name} has no KMS key (a CMK of its Region)")
        if "global_cluster_identifier" in body and "manage_master_user_password" in body:
            problems.append(
                f"{f}: aws_rds_cluster.{name} is a global-cluster member with manage_master_user_password "
                "(AWS refuses it there: take the password from Secrets Manager)"
            )
    return problems


def check_aurora_regions(root):
    """Both Regions' clusters join the global cluster; only the primary brings a password."""
    problems = []
    calls = {n: b for _, _, n, b in root.modules if b.get("source") == MODULE_SOURCE}
    primaries = [n for n, b in calls.items() if b.get("aurora_primary") is True]
    if len(primaries) != 1:
        problems.append(f"exactly one Region must hold the Aurora primary, got {primaries}")
    for n, b in calls.items():
        if not b.get("global_cluster_id"):
            problems.append(f"module {n} joins no global cluster")
        if b.get("aurora_primary") is not True and b.get("db_master_pass") is not None:
            problems.append(f"module {n} is a secondary but gets a master password")
    return problems


def check_encryption(cfg):
    problems = []
    for f, name, body in cfg.of_type("aws_elasticache_replication_group"):
        for attr in ("at_rest_encryption_enabled", "transit_encryption_enabled"):
            if body.get(attr) is not True:
                problems.append(f"{f}: aws_elasticache_replication_group.{name} {attr} is not true")
        for attr in ("kms_key_id", "auth_token"):
            if not body.get(attr):
                problems.append(f"{f}: aws_elasticache_replication_group.{name} has no {attr}")
    for f, name, body in cfg.of_type("aws_secretsmanager_secret"):
        if not body.get("kms_key_id"):
            problems.append(f"{f}: aws_secretsmanager_secret.{name} has no KMS key")
        for r in blocks(body, "replica"):
            if not r.get("kms_key_id"):
                problems.append(f"{f}: aws_secretsmanager_secret.{name} replica has no KMS key")
    for f, name, body in cfg.of_type("aws_kms_key"):
        if body.get("enable_key_rotation") is not True:
            problems.append(f"{f}: aws_kms_key.{name} has no key rotation")
    for f, name, body in cfg.of_type("aws_cloudwatch_log_group"):
        if not body.get("kms_key_id"):
            problems.append(f"{f}: aws_cloudwatch_log_group.{name} has no KMS key")
    for f, name, body in cfg.of_type("aws_ecr_repository"):
        if [e.get("encryption_type") for e in blocks(body, "encryption_configuration")] != ["KMS"]:
            problems.append(f"{f}: aws_ecr_repository.{name} is not KMS-encrypted")
    return problems


def check_route53_failover(cfg):
    problems = []
    failover = []
    for f, name, body in cfg.of_type("aws_route53_record"):
        for pol in blocks(body, "failover_routing_policy"):
            failover.append((f, name, body, pol.get("type")))
    types = sorted(str(t) for *_, t in failover)
    if types != ["PRIMARY", "SECONDARY"]:
        problems.append(f"want one PRIMARY and one SECONDARY failover record, got {types}")
    for f, name, body, _ in failover:
        for attr in ("health_check_id", "set_identifier"):
            if not body.get(attr):
                problems.append(f"{f}: aws_route53_record.{name} has no {attr}")
    if len({str(b.get("name")) for _, _, b, _ in failover}) > 1:
        problems.append("the failover records have different names")
    return problems


SECRET_ATTRS = {"password", "master_password", "auth_token", "secret_string", "token", "api_key", "private_key"}


def check_no_literal_secrets(cfg):
    problems = []
    for f, rtype, name, body in cfg.resources + cfg.data:
        for path, key, value in walk(body):
            if key in SECRET_ATTRS and isinstance(value, str) and "${" not in value:
                problems.append(f"{f}: {rtype}.{name}{path}.{key} is a literal secret")
    for name, var in cfg.variables.items():
        if var.get("sensitive") is True and var.get("default") is not None:
            problems.append(f"variable {name} is sensitive and has a default")
    for f, doc in cfg.docs.items():
        text = json.dumps(doc)
        for pattern in (r"sk_live_[A-Za-z0-9]{8,}", r"whsec_[A-Za-z0-9]{8,}", r"-----BEGIN [A-Z ]*PRIVATE KEY"):
            if re.search(pattern, text):
                problems.append(f"{f}: looks like a key ({pattern})")
    return problems


def check_described(cfg):
    problems = []
    for name, var in cfg.variables.items():
        if not str(var.get("description") or "").strip():
            problems.append(f"variable {name} has no description")
    for f, _, name, body in cfg.outputs:
        if not str(body.get("description") or "").strip():
            problems.append(f"{f}: output {name} has no description")
    return problems


def binary_roles(runtime_rs):
    """The roles `boxoffice serve --roles` accepts by default (Role::ALL), by name."""
    names = dict(re.findall(r"Role::(\w+) => \"(\w+)\"", runtime_rs))
    m = re.search(r"pub const ALL: \[Role; \d+\]\s*=\s*\[([^\]]*)\]", runtime_rs)
    return {names[v] for v in re.findall(r"Role::(\w+)", m.group(1))} if m else set()


def check_services(root, module, roles):
    """One ECS service per role of the binary, each running `serve --roles <that role>`."""
    problems = []
    deployed = set((root.variables.get("services") or {}).get("default") or {})
    if deployed != roles:
        problems.append(f"services {sorted(deployed)} differ from the binary's roles {sorted(roles)}")
    for f, name, body in module.of_type("aws_ecs_task_definition"):
        if not re.search(r'"--roles",\s*each\.key', str(body.get("container_definitions"))):
            problems.append(f"{f}: aws_ecs_task_definition.{name} does not run `serve --roles <its role>`")
    services = module.of_type("aws_ecs_service")
    if not services or any(expr(b.get("for_each")) != "local.roles" for _, _, b in services):
        problems.append("the ECS services are not one per entry of local.roles")
    return problems


# ---- region epoch and witness (design §15) ---------------------------------------------------
#
# The container definitions are built from locals (`local.roles`: per role an `env` map and a
# list of `secrets`, mapped through `local.secret_env`), so the checker renders them: it reads
# the `secrets = distinct(concat(...))` and `env = tomap(merge(...))` of `local.roles` and
# follows each argument (module locals, `var.X` into every module call, the root's locals and
# variable defaults). What it cannot follow counts as absent.

REGION_ENV = ("BOXOFFICE_REGION", "BOXOFFICE_REGION_EPOCH")
WITNESS_SECRET = "BOXOFFICE_WITNESS_DATABASE_URL"
PEER_SECRET = "BOXOFFICE_REGION_PEER_DATABASE_URL"
REGION_NAME = re.compile(r"[A-Za-z0-9_-]+")  # Config::validate_region


def split_top(text, sep=","):
    """Split at `sep` outside brackets and string literals."""
    parts, cur, depth, quoted, i = [], [], 0, False, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\" and i + 1 < len(text):
                cur.append(text[i : i + 2])
                i += 2
                continue
            quoted = c != '"'
        elif c == '"':
            quoted = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur, i = [], i + 1
            continue
        cur.append(c)
        i += 1
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def call_args(text, *fns):
    """`f(g(a, b))` with fns ("f", "g") -> ["a", "b"]; None when it is not that call."""
    text = expr(text).strip() if isinstance(text, str) else text
    for fn in fns:
        if not (isinstance(text, str) and text.startswith(fn + "(") and text.endswith(")")):
            return None
        text = text[len(fn) + 1 : -1].strip()
    return split_top(text)


def object_fields(text):
    """`{a = x, "b" = y}` -> {"a": "x", "b": "y"}; None when it is not an object literal."""
    text = expr(text).strip() if isinstance(text, str) else text
    if not (isinstance(text, str) and text.startswith("{") and text.endswith("}")) or text.startswith("{for "):
        return None
    fields = {}
    for part in split_top(text[1:-1]):
        key, eq, value = part.partition("=")
        if not eq:
            return None
        fields[key.strip().strip('"')] = value.strip()
    return fields


class RootText(str):
    """Expression text already in the root's terms (not followed again as the module's)."""


def in_root(value):
    if isinstance(value, str):
        return RootText(value)
    if isinstance(value, dict):
        return {k: in_root(v) for k, v in value.items()}
    if isinstance(value, list):
        return [in_root(v) for v in value]
    return value


class RegionTasks:
    """The container environment and secrets of every role in every Region, as far as the
    HCL can be followed: `tasks[(call, role)] = {"env": {NAME: value}, "secrets": {NAME: valueFrom}}`,
    values resolved into the root's terms (a literal, a number, or expression text)."""

    def __init__(self, root, module):
        self.root, self.module = root, module
        self.calls = {n: b for _, _, n, b in root.modules if b.get("source") == MODULE_SOURCE}
        self.problems = []
        self.tasks = {}
        roles_def = expr(module.locals.get("roles"))
        m = re.fullmatch(r"\{for (\w+), (\w+) in (\S+) : \1 => (\{.*\})\}", str(roles_def), re.S)
        fields = object_fields(m.group(4)) if m else None
        if not fields or "env" not in fields or "secrets" not in fields:
            self.problems.append("local.roles is not `{for role, s in var.services : role => {... env = ..., secrets = ...}}`")
            return
        self.role_var = m.group(1)
        roles = sorted(((root.variables.get("services") or {}).get("default") or {}))
        for call_name, call in self.calls.items():
            for role in roles:
                self.tasks[(call_name, role)] = {
                    "env": self._env(fields["env"], call, role),
                    "secrets": self._secrets(fields["secrets"], call, role),
                }

    # -- following expressions --

    def root_value(self, value):
        e = expr(value)
        if not isinstance(e, str):
            return e
        m = re.fullmatch(r"(var|local)\.(\w+)((?:\.\w+)*)", e)
        if not m:
            return in_root(e)
        kind, name, path = m.groups()
        if kind == "var":
            base = (self.root.variables.get(name) or {}).get("default")
        else:
            base = self.root.locals.get(name)
        for part in filter(None, path.split(".")):
            if isinstance(base, dict):
                base = base.get(part)
            elif isinstance(base, str):
                break  # an expression (a `for`): its text
            else:
                return None
        return in_root(base)

    def value(self, value, call, role):
        """A module expression in the root's terms, for one module call and role."""
        if isinstance(value, RootText):
            return value
        e = expr(value)
        if not isinstance(e, str):
            return e
        e = e.strip()
        args = call_args(e, "tostring")
        if args and len(args) == 1:
            v = self.value(args[0], call, role)
            return None if v is None else str(v)
        m = re.fullmatch(r"var\.(\w+)", e)
        if m:
            name = m.group(1)
            if name in call:
                return self.root_value(call[name])
            return (self.module.variables.get(name) or {}).get("default")
        m = re.fullmatch(r"local\.(\w+)(?:\[(\w+)\])?((?:\.\w+)*)", e)
        if m:
            name, index, path = m.groups()
            base = self.module.locals.get(name)
            if index is not None:
                key = role if index == self.role_var else index
                base = base.get(key) if isinstance(base, dict) else None
            for part in filter(None, path.split(".")):
                base = self.field(base, part, call, role)
            return base
        return e

    def field(self, base, key, call, role):
        if isinstance(base, dict):
            return self.value(base[key], call, role) if key in base else None
        merged = call_args(base, "merge") if isinstance(base, str) else None
        if merged is None:
            return None
        for arg in reversed(merged):  # the last map that has the key wins
            fields = object_fields(arg)
            if fields is None:
                v = self.value(arg, call, role)
                fields = v if isinstance(v, dict) else {}
            if key in fields:
                return self.value(fields[key], call, role)
        return None

    def _maps(self, text, fns, call, role, kind):
        args = call_args(text, *fns)
        if args is None:
            self.problems.append(f"local.roles {kind} is not {'('.join(fns)}(...): {expr(text)!r}")
            return []
        out = []
        for arg in args:
            m = re.fullmatch(r"contains\(local\.(\w+), (\w+)\) \? (\S+) : (\{\}|\[\])", arg)
            if m:  # `contains(local.kafka_roles, role) ? local.kafka_env : {}`
                members = self.module.locals.get(m.group(1)) or []
                if m.group(2) == self.role_var and role in members:
                    out.append(self.value(m.group(3), call, role))
                continue
            if "?" in arg:
                continue  # another condition: not counted on
            out.append(self.value(arg, call, role))
        return out

    def _env(self, text, call, role):
        env = {}
        for m in self._maps(text, ("tomap", "merge"), call, role, "env"):
            if isinstance(m, dict):
                env.update({f"BOXOFFICE_{k}": self.value(v, call, role) for k, v in m.items()})
        return env

    def _secrets(self, text, call, role):
        names = []
        for lst in self._maps(text, ("distinct", "concat"), call, role, "secrets"):
            if isinstance(lst, list):
                names += [n for n in lst if n not in names]
        secret_env = self.module.locals.get("secret_env") or {}
        out = {}
        for name in names:
            if not isinstance(secret_env.get(name), dict):
                self.problems.append(f"secret {name} has no entry in local.secret_env")
                continue
            for k, v in secret_env[name].items():
                out[f"BOXOFFICE_{k}"] = self.value(v, call, role)
        return out


def provider_region(root, call):
    alias = str(expr((call.get("providers") or {}).get("aws")))
    for _, _, name, body in root.providers:
        if name == "aws" and f"aws.{body.get('alias')}" == alias:
            return expr(body.get("region"))
    return None


def check_region_env(root, module):
    """Every role in both Regions starts with BOXOFFICE_REGION (distinct per Region, a valid
    name), BOXOFFICE_REGION_EPOCH (a whole number >= 1, distinct per Region), the witness's URL
    from var.witness_database_url_secret_arn and the other Region's database URL; its execution
    role may read every secret it gets, and the other Region's database-url secret is
    replicated into it under a key it may decrypt."""
    r = RegionTasks(root, module)
    problems = list(r.problems)
    if len(r.calls) != 2:
        problems.append(f"want the region module in two Regions, got {sorted(r.calls)}")
    by_region = {}
    for (call_name, role), task in sorted(r.tasks.items()):
        where = f"module {call_name} role {role}"
        env, secrets = task["env"], task["secrets"]
        for name in REGION_ENV:
            if name not in env:
                problems.append(f"{where}: no {name} in the environment")
        for name in (WITNESS_SECRET, PEER_SECRET):
            if name in env:
                problems.append(f"{where}: {name} is a plain environment variable, not a secret")
        witness = secrets.get(WITNESS_SECRET)
        if witness is None:
            problems.append(f"{where}: no {WITNESS_SECRET} secret")
        elif "var.witness_database_url_secret_arn" not in str(witness):
            problems.append(f"{where}: {WITNESS_SECRET} is {witness!r}, not from var.witness_database_url_secret_arn")
        peer = secrets.get(PEER_SECRET)
        others = [n for n in r.calls if n != call_name]
        if peer is None:
            problems.append(f"{where}: no {PEER_SECRET} secret")
        elif not any(f"module.{o}.database_url_secret_arn" in str(peer) for o in others):
            problems.append(f"{where}: {PEER_SECRET} is {peer!r}, not the other Region's database-url secret")
        by_region.setdefault(call_name, set()).add((env.get(REGION_ENV[0]), env.get(REGION_ENV[1])))
    regions, epochs = {}, {}
    for call_name, values in sorted(by_region.items()):
        if len(values) != 1:
            problems.append(f"module {call_name}: its roles differ in region or epoch: {sorted(map(str, values))}")
            continue
        (region, epoch), = values
        if not isinstance(region, str) or not REGION_NAME.fullmatch(region):
            problems.append(f"module {call_name}: BOXOFFICE_REGION is {region!r}, want a name of letters, digits, '-', '_'")
        if not (isinstance(epoch, str) and epoch.isdigit() and int(epoch) >= 1):
            problems.append(f"module {call_name}: BOXOFFICE_REGION_EPOCH is {epoch!r}, want a whole number >= 1")
        regions[call_name], epochs[call_name] = region, epoch
    if len(regions) > 1 and len(set(map(str, regions.values()))) != len(regions):
        problems.append(f"the Regions have the same BOXOFFICE_REGION: {regions}")
    if len(epochs) > 1 and len(set(map(str, epochs.values()))) != len(epochs):
        problems.append(f"the Regions have the same BOXOFFICE_REGION_EPOCH: {epochs}")

    # The task definition passes env and secrets on as BOXOFFICE_<KEY>.
    for f, name, body in module.of_type("aws_ecs_task_definition"):
        cd = str(body.get("container_definitions"))
        if not re.search(r'environment = \[for (\w+), (\w+) in each\.value\.env : \{name = "BOXOFFICE_\$\{\1\}", value = \2\}\]', cd):
            problems.append(f"{f}: aws_ecs_task_definition.{name} does not pass each.value.env as BOXOFFICE_<KEY>")
        if not re.search(
            r'secrets = flatten\(\[for (\w+) in each\.value\.secrets : \[for (\w+), (\w+) in local\.secret_env\[\1\] : '
            r'\{name = "BOXOFFICE_\$\{\2\}", valueFrom = \3\}\]\]\)', cd
        ):
            problems.append(f"{f}: aws_ecs_task_definition.{name} does not pass each.value.secrets through local.secret_env")
    # Its execution role may read exactly those secrets and decrypt them with the Region's key.
    policies = [(f, n, str(b.get("policy"))) for f, n, b in module.of_type("aws_iam_role_policy") if n == "execution"]
    if not policies:
        problems.append("no aws_iam_role_policy.execution")
    for f, name, policy in policies:
        if not re.search(r'"secretsmanager:GetSecretValue", Resource = \[for (\w+) in each\.value\.secrets : local\.secret_arns\[\1\]\]', policy):
            problems.append(f"{f}: aws_iam_role_policy.{name} does not allow GetSecretValue on every secret of the role")
        if not re.search(r'"kms:Decrypt", Resource = aws_kms_key\.this\["secrets"\]\.arn', policy):
            problems.append(f"{f}: aws_iam_role_policy.{name} may not decrypt with the Region's secrets key")
    # The other Region's database-url reaches this one as a replica under this Region's key.
    db_url = [b for _, n, b in module.of_type("aws_secretsmanager_secret") if n == "database_url"]
    replicas = [rep for b in db_url for rep in blocks(b, "replica")]
    if not any(expr(rep.get("region")) == "var.peer_region" and expr(rep.get("kms_key_id")) == "var.peer_secrets_kms_key_arn" for rep in replicas):
        problems.append("aws_secretsmanager_secret.database_url has no replica in var.peer_region under var.peer_secrets_kms_key_arn")
    for call_name, call in r.calls.items():
        others = {o: c for o, c in r.calls.items() if o != call_name}
        m = re.fullmatch(r"local\.\w+\.(\w+)", str(expr(call.get("witness_database_url_secret_arn"))))
        if m and m.group(1) != call_name:
            problems.append(f"module {call_name}: reads the {m.group(1)} Region's copy of the witness secret")
        if expr(call.get("peer_region")) not in [provider_region(root, c) for c in others.values()]:
            problems.append(f"module {call_name}: peer_region is {call.get('peer_region')!r}, not the other Region's")
        if not any(expr(call.get("peer_secrets_kms_key_arn")) == f"module.{o}.kms_key_arns.secrets" for o in others):
            problems.append(f"module {call_name}: peer_secrets_kms_key_arn is not the other Region's secrets key")
    return problems


def check_witness_reachable(module):
    """The API and worker tasks may open connections to the witness (outside both Regions)."""
    problems = []
    rules = [
        (n, b) for _, n, b in module.of_type("aws_vpc_security_group_egress_rule")
        if expr(b.get("from_port")) == "var.witness_port" and expr(b.get("to_port")) == "var.witness_port"
    ]
    if not rules:
        problems.append("no egress rule on var.witness_port: the tasks cannot renew their region lease")
    for name, body in rules:
        each = str(body.get("for_each"))
        for group in ("api", "worker"):
            if f'"{group}"' not in each:
                problems.append(f"aws_vpc_security_group_egress_rule.{name}: no rule for the {group} group")
        if "var.witness_cidrs" not in each or not body.get("cidr_ipv4"):
            problems.append(f"aws_vpc_security_group_egress_rule.{name} is not to var.witness_cidrs")
    return problems


# ---- the real configuration ----------------------------------------------------------------


ROOT = load_dir(INFRA)
MODULE = load_dir(INFRA / "modules" / "region")
BOTH = (("root", ROOT), ("modules/region", MODULE))


class RealConfiguration(unittest.TestCase):
    def test_every_resource_uses_the_provider_of_its_region(self):
        self.assertEqual(check_root_providers(ROOT), [])

    def test_nothing_picks_a_region_behind_the_provider(self):
        self.assertEqual(check_inherits_region(ROOT, is_root=True), [])
        self.assertEqual(check_inherits_region(MODULE, is_root=False), [])

    def test_ecs_tasks_have_no_public_ip_and_run_in_private_subnets(self):
        self.assertTrue(MODULE.of_type("aws_ecs_service"))
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_ecs_private(cfg), [])

    def test_data_services_are_private(self):
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_private_placement(cfg), [])

    def test_msk_brokers_multiple_of_three_and_safe_replication(self):
        self.assertEqual(check_msk(MODULE, Resolver(ROOT, MODULE)), [])

    def test_aurora_encrypted_protected_and_no_managed_password_on_global_members(self):
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_aurora(cfg), [])
        self.assertTrue(MODULE.of_type("aws_rds_cluster") and ROOT.of_type("aws_rds_global_cluster"))
        self.assertEqual(check_aurora_regions(ROOT), [])

    def test_encryption_of_redis_secrets_keys_logs_images(self):
        self.assertTrue(MODULE.of_type("aws_elasticache_replication_group"))
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_encryption(cfg), [])

    def test_route53_has_primary_and_secondary_failover_records(self):
        self.assertEqual(check_route53_failover(ROOT), [])

    def test_no_hard_coded_secrets(self):
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_no_literal_secrets(cfg), [])

    def test_variables_and_outputs_are_described(self):
        for where, cfg in BOTH:
            with self.subTest(where):
                self.assertEqual(check_described(cfg), [])

    def test_one_service_per_role_of_the_binary(self):
        roles = binary_roles((REPO / "crates/boxoffice/src/runtime.rs").read_text())
        self.assertIn("api", roles)
        self.assertEqual(check_services(ROOT, MODULE, roles), [])

    def test_every_role_starts_with_region_epoch_and_witness(self):
        self.assertEqual(check_region_env(ROOT, MODULE), [])
        tasks = RegionTasks(ROOT, MODULE).tasks
        roles = set((ROOT.variables["services"]["default"]))
        self.assertEqual({role for _, role in tasks}, roles)
        for (region, role), task in sorted(tasks.items()):
            with self.subTest(f"{region} {role}"):
                self.assertEqual(task["env"]["BOXOFFICE_REGION"], region)
                self.assertIn("BOXOFFICE_REGION_EPOCH", task["env"])
                self.assertIn("var.witness_database_url_secret_arn", task["secrets"][WITNESS_SECRET])
                other = "dr" if region == "primary" else "primary"
                self.assertIn(f"module.{other}.database_url_secret_arn", task["secrets"][PEER_SECRET])
        regions = {region: task["env"]["BOXOFFICE_REGION"] for (region, _), task in tasks.items()}
        self.assertEqual(len(set(regions.values())), 2, f"the two Regions' BOXOFFICE_REGION must differ: {regions}")
        epochs = {region: task["env"]["BOXOFFICE_REGION_EPOCH"] for (region, _), task in tasks.items()}
        self.assertEqual(epochs, {"primary": "1", "dr": "2"}, "default epochs: primary 1, DR its first promotion's")

    def test_each_region_reads_its_own_copy_of_the_witness_secret(self):
        text = expr(ROOT.locals["witness_secret_arns"])
        m = re.search(r'replace\(var\.witness_database_url_secret_arn, "/(.+?)/", "(.+?)"\)', text)
        self.assertTrue(m, text)
        pattern, replacement = m.group(1), m.group(2).replace("$1", r"\1").replace("${region}", "eu-central-1")
        arn = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:boxoffice/witness-url-AbCdEf"
        self.assertEqual(
            re.sub(pattern, replacement, arn),
            "arn:aws:secretsmanager:eu-central-1:123456789012:secret:boxoffice/witness-url-AbCdEf",
        )
        condition = ROOT.variables["witness_database_url_secret_arn"]["validation"][0]["condition"]
        valid = re.search(r'regex\("(.+?)", var\.', condition).group(1).replace("\\\\", "\\")
        self.assertRegex(arn, valid)
        self.assertNotRegex("boxoffice/witness-url", valid)

    def test_the_services_are_told_where_webhooks_may_come_from(self):
        settings = ROOT.locals["app_settings"]
        self.assertEqual(settings.get("ENV"), "production")
        self.assertIn("jsonencode(var.webhook_allowed_networks)", str(settings.get("WEBHOOK_ALLOWED_NETWORKS")))
        condition = ROOT.variables["webhook_allowed_networks"]["validation"][0]["condition"]
        self.assertIn("length(var.webhook_allowed_networks) > 0", condition)

    def test_the_load_balancer_and_dns_check_liveness_not_readiness(self):
        # /readyz is 503 in a fenced or standby region; ECS would replace those tasks in a loop.
        groups = MODULE.of_type("aws_lb_target_group")
        self.assertTrue(groups)
        for _, name, body in groups:
            for check in blocks(body, "health_check"):
                self.assertEqual(check.get("path"), "/healthz", name)
        checks = [b for _, n, b in ROOT.of_type("aws_route53_health_check") if b.get("type") == "HTTPS"]
        self.assertTrue(checks)
        paths = {b.get("resource_path") for b in checks}
        self.assertIn("/healthz", paths)
        self.assertNotIn("/readyz", paths)

    def test_tasks_reach_the_witness(self):
        self.assertEqual(check_witness_reachable(MODULE), [])

    def test_every_checkov_baseline_entry_has_a_reason_in_the_readme(self):
        baseline = json.loads((INFRA / ".checkov.baseline").read_text())
        ids = {c for f in baseline["failed_checks"] for r in f["findings"] for c in r["check_ids"]}
        readme = (INFRA / "README.md").read_text()
        section = readme.split("## checkov baseline", 1)[-1]
        for check_id in sorted(ids):
            with self.subTest(check_id):
                self.assertRegex(section, rf"\| `?{check_id}`? \|", f"{check_id} has no reason in infra/README.md")


# ---- each checker catches what it is for ---------------------------------------------------


GOOD_ROOT = """
provider "aws" {
  alias  = "primary"
  region = var.primary_region
}
provider "aws" {
  alias  = "dr"
  region = var.dr_region
}
resource "aws_rds_global_cluster" "g" {
  provider            = aws.primary
  storage_encrypted   = true
  deletion_protection = true
}
module "primary" {
  source            = "./modules/region"
  providers         = { aws = aws.primary }
  aurora_primary    = true
  global_cluster_id = aws_rds_global_cluster.g.id
  db_master_pass    = random_password.p.result
}
module "dr" {
  source            = "./modules/region"
  providers         = { aws = aws.dr }
  aurora_primary    = false
  global_cluster_id = module.primary.global_cluster_id
  db_master_pass    = null
}
"""


class CheckersCatchBreakage(unittest.TestCase):
    def assertCaught(self, problems, fragment):
        self.assertTrue(any(fragment in p for p in problems), f"{fragment!r} not in {problems}")

    def test_good_root_snippet_passes(self):
        cfg = from_text(GOOD_ROOT)
        self.assertEqual(check_root_providers(cfg), [])
        self.assertEqual(check_aurora_regions(cfg), [])

    def test_dr_resource_on_primary_provider(self):
        cfg = from_text(GOOD_ROOT + 'resource "aws_security_group" "dr_x" {\n  provider = aws.primary\n}\n')
        self.assertCaught(check_root_providers(cfg), "aws_security_group.dr_x uses provider 'aws.primary'")

    def test_primary_resource_on_dr_provider_or_none(self):
        cfg = from_text(GOOD_ROOT + 'resource "aws_kms_key" "k" {\n  provider = aws.dr\n}\nresource "aws_sns_topic" "t" {}\n')
        problems = check_root_providers(cfg)
        self.assertCaught(problems, "aws_kms_key.k uses provider 'aws.dr'")
        self.assertCaught(problems, "aws_sns_topic.t uses provider None")

    def test_dr_module_on_primary_provider(self):
        cfg = from_text(GOOD_ROOT.replace("providers         = { aws = aws.dr }", "providers         = { aws = aws.primary }"))
        problems = check_root_providers(cfg)
        self.assertCaught(problems, "module dr gets aws = 'aws.primary'")
        self.assertCaught(problems, "once per Region")

    def test_default_provider(self):
        cfg = from_text(GOOD_ROOT + 'provider "aws" {\n  region = "us-east-1"\n}\n')
        self.assertCaught(check_root_providers(cfg), "without alias")

    def test_region_override_and_provider_inside_module(self):
        snippet = 'resource "aws_sqs_queue" "q" {\n  provider = aws.dr\n  region = "us-east-1"\n}\n'
        self.assertCaught(check_inherits_region(from_text(snippet), is_root=False), "sets region")
        self.assertCaught(check_inherits_region(from_text(snippet), is_root=False), "sets provider inside")
        self.assertCaught(check_inherits_region(from_text(snippet), is_root=True), "sets region")

    def test_public_ip_on_ecs_task(self):
        snippet = """
resource "aws_ecs_service" "s" {
  network_configuration {
    assign_public_ip = true
    subnets          = aws_subnet.private[*].id
  }
}"""
        self.assertCaught(check_ecs_private(from_text(snippet)), "assign_public_ip is True")
        ok = snippet.replace("assign_public_ip = true", "assign_public_ip = false")
        self.assertEqual(check_ecs_private(from_text(ok)), [])
        implicit = snippet.replace("assign_public_ip = true", "")
        self.assertCaught(check_ecs_private(from_text(implicit)), "assign_public_ip is None")

    def test_ecs_task_in_public_subnets(self):
        snippet = """
resource "aws_ecs_service" "s" {
  network_configuration {
    assign_public_ip = false
    subnets          = aws_subnet.public[*].id
  }
}"""
        self.assertCaught(check_ecs_private(from_text(snippet)), "want the private subnets")

    def test_public_data_services(self):
        snippet = """
resource "aws_subnet" "s" {
  map_public_ip_on_launch = true
}
resource "aws_db_subnet_group" "d" {
  subnet_ids = aws_subnet.public[*].id
}
resource "aws_rds_cluster_instance" "i" {
  publicly_accessible = true
}
resource "aws_msk_cluster" "m" {
  broker_node_group_info {
    client_subnets = aws_subnet.private[*].id
    connectivity_info {
      public_access {
        type = "SERVICE_PROVIDED_EIPS"
      }
    }
  }
}"""
        problems = check_private_placement(from_text(snippet))
        for fragment in ("public IPs on launch", "aws_db_subnet_group.d", "publicly_accessible", "public access"):
            self.assertCaught(problems, fragment)

    MSK = """
resource "aws_msk_configuration" "c" {
  server_properties = <<-P
    default.replication.factor=3
    min.insync.replicas=2
    unclean.leader.election.enable=false
  P
}
resource "aws_msk_cluster" "m" {
  number_of_broker_nodes = 3
  client_authentication {
    unauthenticated = false
  }
  encryption_info {
    encryption_at_rest_kms_key_arn = aws_kms_key.k.arn
    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }
  configuration_info {
    arn = aws_msk_configuration.c.arn
  }
}
"""

    def test_good_msk_snippet_passes(self):
        self.assertEqual(check_msk(from_text(self.MSK)), [])

    def test_msk_broker_count_not_multiple_of_three(self):
        self.assertCaught(check_msk(from_text(self.MSK.replace("= 3\n  client", "= 4\n  client"))), "4 brokers")

    def test_msk_broker_count_through_variables(self):
        module = from_text(
            self.MSK.replace("number_of_broker_nodes = 3", "number_of_broker_nodes = var.n")
            + 'variable "n" {\n  validation {\n    condition = var.n % 3 == 0\n  }\n}\n'
        )
        root = from_text(
            'module "primary" {\n  source = "./modules/region"\n  n = var.n\n}\n'
            'variable "n" {\n  default = 5\n}\n'
        )
        problems = check_msk(module, Resolver(root, module))
        self.assertCaught(problems, "5 brokers")
        self.assertCaught(problems, "variable n has no validation")

    def test_msk_unsafe_server_properties(self):
        broken = self.MSK.replace("min.insync.replicas=2", "min.insync.replicas=1").replace(
            "unclean.leader.election.enable=false", "unclean.leader.election.enable=true"
        )
        problems = check_msk(from_text(broken))
        self.assertCaught(problems, "min.insync.replicas='1'")
        self.assertCaught(problems, "unclean.leader.election.enable='true'")
        missing = self.MSK.replace("    default.replication.factor=3\n", "")
        self.assertCaught(check_msk(from_text(missing)), "default.replication.factor=None")

    def test_msk_plaintext_or_unauthenticated(self):
        broken = self.MSK.replace('client_broker = "TLS"', 'client_broker = "TLS_PLAINTEXT"').replace(
            "unauthenticated = false", "unauthenticated = true"
        )
        problems = check_msk(from_text(broken))
        self.assertCaught(problems, "not TLS-only")
        self.assertCaught(problems, "unauthenticated = false")
        no_kms = self.MSK.replace("encryption_at_rest_kms_key_arn = aws_kms_key.k.arn", "")
        self.assertCaught(check_msk(from_text(no_kms)), "no KMS key")

    def test_manage_master_user_password_on_global_member(self):
        snippet = """
resource "aws_rds_cluster" "c" {
  global_cluster_identifier   = aws_rds_global_cluster.g.id
  manage_master_user_password = true
  storage_encrypted           = true
  kms_key_id                  = aws_kms_key.k.arn
  deletion_protection         = true
}"""
        self.assertCaught(check_aurora(from_text(snippet)), "manage_master_user_password")
        ok = snippet.replace("  manage_master_user_password = true\n", "")
        self.assertEqual(check_aurora(from_text(ok)), [])

    def test_aurora_unencrypted_or_unprotected(self):
        snippet = """
resource "aws_rds_global_cluster" "g" {
  storage_encrypted = false
}
resource "aws_rds_cluster" "c" {
  storage_encrypted   = true
  deletion_protection = false
}"""
        problems = check_aurora(from_text(snippet))
        self.assertCaught(problems, "aws_rds_global_cluster.g storage_encrypted")
        self.assertCaught(problems, "aws_rds_global_cluster.g deletion_protection")
        self.assertCaught(problems, "aws_rds_cluster.c deletion_protection")
        self.assertCaught(problems, "aws_rds_cluster.c has no KMS key")

    def test_secondary_with_password_or_two_primaries(self):
        broken = GOOD_ROOT.replace("db_master_pass    = null", "db_master_pass    = var.pw")
        self.assertCaught(check_aurora_regions(from_text(broken)), "secondary but gets a master password")
        two = GOOD_ROOT.replace("aurora_primary    = false", "aurora_primary    = true")
        self.assertCaught(check_aurora_regions(from_text(two)), "exactly one Region")

    def test_unencrypted_redis_secret_key_log(self):
        snippet = """
resource "aws_elasticache_replication_group" "r" {
  at_rest_encryption_enabled = true
  transit_encryption_enabled = false
  kms_key_id                 = aws_kms_key.k.arn
}
resource "aws_secretsmanager_secret" "s" {
  replica {
    region = var.dr_region
  }
}
resource "aws_kms_key" "k" {
  enable_key_rotation = false
}
resource "aws_cloudwatch_log_group" "l" {}
"""
        problems = check_encryption(from_text(snippet))
        for fragment in ("transit_encryption_enabled", "no auth_token", "secret.s has no KMS", "replica has no KMS",
                         "no key rotation", "log_group.l has no KMS"):
            self.assertCaught(problems, fragment)

    def test_route53_without_secondary(self):
        snippet = """
resource "aws_route53_record" "a" {
  name            = "api"
  set_identifier  = "a"
  health_check_id = aws_route53_health_check.a.id
  failover_routing_policy {
    type = "PRIMARY"
  }
}
resource "aws_route53_record" "b" {
  name = "api"
  failover_routing_policy {
    type = "PRIMARY"
  }
}"""
        problems = check_route53_failover(from_text(snippet))
        self.assertCaught(problems, "one PRIMARY and one SECONDARY")
        self.assertCaught(problems, "record.b has no health_check_id")

    def test_literal_secrets(self):
        snippet = """
resource "aws_rds_cluster" "c" {
  master_password = "hunter2hunter2"
}
resource "aws_secretsmanager_secret_version" "v" {
  secret_string = "sk_live_abcdefghijklmnop"
}
variable "pw" {
  sensitive = true
  default   = "x"
}"""
        problems = check_no_literal_secrets(from_text(snippet))
        self.assertCaught(problems, "master_password is a literal secret")
        self.assertCaught(problems, "secret_string is a literal secret")
        self.assertCaught(problems, "looks like a key")
        self.assertCaught(problems, "variable pw is sensitive")

    def test_undescribed_variable_and_output(self):
        problems = check_described(from_text('variable "v" {}\noutput "o" {\n  value = 1\n}\n'))
        self.assertCaught(problems, "variable v has no description")
        self.assertCaught(problems, "output o has no description")

    def test_service_for_a_role_the_binary_does_not_have(self):
        roles = binary_roles(
            'Role::Api => "api",\nRole::Relay => "relay",\nRole::Router => "router",\n'
            "pub const ALL: [Role; 2] =\n        [Role::Api, Role::Relay];"
        )
        self.assertEqual(roles, {"api", "relay"})
        root = from_text('variable "services" {\n  default = { api = {}, relay = {}, release = {} }\n}\n')
        module = from_text(
            'resource "aws_ecs_task_definition" "t" {\n  container_definitions = jsonencode([{ command = ["serve"] }])\n}\n'
            'resource "aws_ecs_service" "s" {\n  for_each = var.x\n}\n'
        )
        problems = check_services(root, module, roles)
        self.assertCaught(problems, "differ from the binary's roles")
        self.assertCaught(problems, "does not run `serve --roles")
        self.assertCaught(problems, "not one per entry of local.roles")


    # A region module and its two calls, shaped like the real ones (modules/region/ecs.tf).
    REGION_MODULE = """
locals {
  kafka_roles     = ["api"]
  startup_secrets = ["stripe_secret_key"]
  role_secrets    = {
    api    = ["database_url", "kafka"]
    expiry = ["database_url"]
  }
  region_secrets = ["witness_database_url", "region_peer_database_url"]
  region_env     = {
    REGION       = var.region_key
    REGION_EPOCH = tostring(var.region_epoch)
  }
  secret_arns = merge(var.app_secret_arns, {
    database_url             = aws_secretsmanager_secret.database_url.arn
    kafka                    = aws_secretsmanager_secret.kafka_scram.arn
    witness_database_url     = var.witness_database_url_secret_arn
    region_peer_database_url = var.peer_database_url_secret_arn
  })
  secret_env = {
    database_url             = { DATABASE_URL = local.secret_arns.database_url }
    kafka                    = { KAFKA_SASL_PASSWORD = "${local.secret_arns.kafka}:password::" }
    stripe_secret_key        = { STRIPE_SECRET_KEY = local.secret_arns.stripe_secret_key }
    witness_database_url     = { WITNESS_DATABASE_URL = local.secret_arns.witness_database_url }
    region_peer_database_url = { REGION_PEER_DATABASE_URL = local.secret_arns.region_peer_database_url }
  }
  kafka_env = { KAFKA_BROKERS = aws_msk_cluster.this.bootstrap_brokers_sasl_scram }
  roles = {
    for role, s in var.services : role => {
      secrets = distinct(concat(local.role_secrets[role], local.region_secrets, local.startup_secrets))
      env     = tomap(merge(var.app_settings, local.region_env, contains(local.kafka_roles, role) ? local.kafka_env : {}))
    }
  }
}
resource "aws_secretsmanager_secret" "database_url" {
  kms_key_id = aws_kms_key.this["secrets"].arn
  replica {
    region     = var.peer_region
    kms_key_id = var.peer_secrets_kms_key_arn
  }
}
resource "aws_ecs_task_definition" "role" {
  for_each = local.roles
  container_definitions = jsonencode([{
    environment = [for k, v in each.value.env : { name = "BOXOFFICE_${k}", value = v }]
    secrets     = flatten([for s in each.value.secrets : [for k, from in local.secret_env[s] : { name = "BOXOFFICE_${k}", valueFrom = from }]])
  }])
}
resource "aws_iam_role_policy" "execution" {
  for_each = local.roles
  policy = jsonencode({
    Statement = [
      { Action = "secretsmanager:GetSecretValue", Resource = [for s in each.value.secrets : local.secret_arns[s]] },
      { Action = "kms:Decrypt", Resource = aws_kms_key.this["secrets"].arn },
    ]
  })
}
resource "aws_vpc_security_group_egress_rule" "witness" {
  for_each          = { for p in setproduct(["api", "worker"], var.witness_cidrs) : "${p[0]} ${p[1]}" => p }
  security_group_id = aws_security_group.this[each.value[0]].id
  from_port         = var.witness_port
  to_port           = var.witness_port
  cidr_ipv4         = each.value[1]
}
"""
    REGION_ROOT = """
provider "aws" {
  alias  = "primary"
  region = var.primary_region
}
provider "aws" {
  alias  = "dr"
  region = var.dr_region
}
variable "services" {
  default = { api = {}, expiry = {} }
}
variable "region_epochs" {
  default = { primary = 1, dr = 2 }
}
locals {
  app_settings        = { ENV = "production" }
  witness_secret_arns = { for key, region in { primary = var.primary_region, dr = var.dr_region } : key => replace(var.witness_database_url_secret_arn, "/x/", region) }
  peer_arns = {
    primary = replace(module.dr.database_url_secret_arn, var.dr_region, var.primary_region)
    dr      = replace(module.primary.database_url_secret_arn, var.primary_region, var.dr_region)
  }
}
module "primary" {
  source                          = "./modules/region"
  providers                       = { aws = aws.primary }
  region_key                      = "primary"
  region_epoch                    = var.region_epochs.primary
  app_settings                    = local.app_settings
  witness_database_url_secret_arn = local.witness_secret_arns.primary
  peer_region                     = var.dr_region
  peer_secrets_kms_key_arn        = module.dr.kms_key_arns.secrets
  peer_database_url_secret_arn    = local.peer_arns.primary
}
module "dr" {
  source                          = "./modules/region"
  providers                       = { aws = aws.dr }
  region_key                      = "dr"
  region_epoch                    = var.region_epochs.dr
  app_settings                    = local.app_settings
  witness_database_url_secret_arn = local.witness_secret_arns.dr
  peer_region                     = var.primary_region
  peer_secrets_kms_key_arn        = module.primary.kms_key_arns.secrets
  peer_database_url_secret_arn    = local.peer_arns.dr
}
"""

    def region_problems(self, module_edit=("", ""), root_edit=("", "")):
        module, root = self.REGION_MODULE, self.REGION_ROOT
        for text, (old, new) in (("module", module_edit), ("root", root_edit)):
            if old:
                source = module if text == "module" else root
                self.assertIn(old, source)
                if text == "module":
                    module = module.replace(old, new)
                else:
                    root = root.replace(old, new)
        return check_region_env(from_text(root), from_text(module))

    def test_good_region_snippet_passes(self):
        self.assertEqual(self.region_problems(), [])
        self.assertEqual(check_witness_reachable(from_text(self.REGION_MODULE)), [])
        tasks = RegionTasks(from_text(self.REGION_ROOT), from_text(self.REGION_MODULE)).tasks
        self.assertEqual(tasks[("dr", "expiry")]["env"]["BOXOFFICE_REGION_EPOCH"], "2")
        self.assertNotIn("BOXOFFICE_KAFKA_BROKERS", tasks[("dr", "expiry")]["env"])
        self.assertIn("BOXOFFICE_KAFKA_BROKERS", tasks[("dr", "api")]["env"])

    def test_missing_witness_secret(self):
        problems = self.region_problems(('region_secrets = ["witness_database_url", ', 'region_secrets = ['))
        for role in ("api", "expiry"):
            for region in ("primary", "dr"):
                self.assertCaught(problems, f"module {region} role {role}: no BOXOFFICE_WITNESS_DATABASE_URL secret")
        # ... and when the role list does not take the region secrets at all, or only in one role.
        problems = self.region_problems(("local.region_secrets, ", ""))
        self.assertCaught(problems, "role expiry: no BOXOFFICE_WITNESS_DATABASE_URL secret")
        self.assertCaught(problems, "role api: no BOXOFFICE_REGION_PEER_DATABASE_URL secret")
        # Per-role lists count too: the witness in every role's own list is as good.
        module = self.REGION_MODULE.replace('region_secrets = ["witness_database_url", ', "region_secrets = [")
        module = module.replace('"database_url"]', '"database_url", "witness_database_url"]')
        module = module.replace('"database_url", "kafka"]', '"database_url", "kafka", "witness_database_url"]')
        self.assertEqual(check_region_env(from_text(self.REGION_ROOT), from_text(module)), [])
        problems = self.region_problems(
            ("local.region_secrets, ", "contains(local.kafka_roles, role) ? local.region_secrets : [], "),
        )
        self.assertCaught(problems, "module dr role expiry: no BOXOFFICE_WITNESS_DATABASE_URL secret")
        self.assertFalse(any("role api: no BOXOFFICE_WITNESS" in p for p in problems), problems)

    def test_witness_secret_from_elsewhere(self):
        problems = self.region_problems(
            ("witness_database_url     = var.witness_database_url_secret_arn",
             'witness_database_url     = "arn:aws:secretsmanager:eu-west-1:1:secret:w"'),
        )
        self.assertCaught(problems, "not from var.witness_database_url_secret_arn")
        problems = self.region_problems(root_edit=("= local.witness_secret_arns.dr", "= local.witness_secret_arns.primary"))
        self.assertCaught(problems, "module dr: reads the primary Region's copy of the witness secret")
        plain = self.region_problems(("REGION_EPOCH = tostring(var.region_epoch)",
                                      "REGION_EPOCH = tostring(var.region_epoch)\n    WITNESS_DATABASE_URL = var.x"))
        self.assertCaught(plain, "BOXOFFICE_WITNESS_DATABASE_URL is a plain environment variable")

    def test_missing_or_equal_region_and_epoch(self):
        problems = self.region_problems(("    REGION       = var.region_key\n", ""))
        self.assertCaught(problems, "module primary role api: no BOXOFFICE_REGION in the environment")
        problems = self.region_problems(("local.region_env, ", ""))
        self.assertCaught(problems, "no BOXOFFICE_REGION_EPOCH in the environment")
        same = self.region_problems(root_edit=('region_key                      = "dr"', 'region_key                      = "primary"'))
        self.assertCaught(same, "the Regions have the same BOXOFFICE_REGION")
        bad = self.region_problems(root_edit=('region_key                      = "dr"', 'region_key                      = "d r"'))
        self.assertCaught(bad, "module dr: BOXOFFICE_REGION is 'd r'")
        epochs = self.region_problems(root_edit=("primary = 1, dr = 2", "primary = 1, dr = 1"))
        self.assertCaught(epochs, "the Regions have the same BOXOFFICE_REGION_EPOCH")
        zero = self.region_problems(root_edit=("primary = 1, dr = 2", "primary = 0, dr = 2"))
        self.assertCaught(zero, "module primary: BOXOFFICE_REGION_EPOCH is '0'")

    def test_peer_database_url_of_its_own_region(self):
        problems = self.region_problems(root_edit=(
            "dr      = replace(module.primary.database_url_secret_arn", "dr      = replace(module.dr.database_url_secret_arn"))
        self.assertCaught(problems, "module dr role api: BOXOFFICE_REGION_PEER_DATABASE_URL")
        self.assertFalse(any("module primary role" in p for p in problems), problems)
        problems = self.region_problems(root_edit=("peer_region                     = var.primary_region",
                                                    "peer_region                     = var.dr_region"))
        self.assertCaught(problems, "module dr: peer_region")
        problems = self.region_problems(("    region     = var.peer_region\n", ""))
        self.assertCaught(problems, "no replica in var.peer_region")

    def test_secrets_the_execution_role_may_not_read(self):
        problems = self.region_problems(("Resource = [for s in each.value.secrets : local.secret_arns[s]]",
                                         "Resource = [local.secret_arns.database_url]"))
        self.assertCaught(problems, "does not allow GetSecretValue on every secret of the role")
        problems = self.region_problems(('{ Action = "kms:Decrypt", Resource = aws_kms_key.this["secrets"].arn },\n', ""))
        self.assertCaught(problems, "may not decrypt")
        problems = self.region_problems(('name = "BOXOFFICE_${k}", valueFrom', 'name = k, valueFrom'))
        self.assertCaught(problems, "does not pass each.value.secrets through local.secret_env")

    def test_witness_unreachable(self):
        module = from_text(self.REGION_MODULE.replace("from_port         = var.witness_port", "from_port         = 443"))
        self.assertCaught(check_witness_reachable(module), "no egress rule on var.witness_port")
        module = from_text(self.REGION_MODULE.replace('["api", "worker"]', '["api"]'))
        self.assertCaught(check_witness_reachable(module), "no rule for the worker group")

    def test_real_module_without_the_witness_secret(self):
        """The checker catches it in the real files too, not only in the snippet's shape."""
        docs = dict(MODULE.docs)
        text = (INFRA / "modules/region/ecs.tf").read_text()
        old = 'region_secrets = ["witness_database_url", "region_peer_database_url"]'
        self.assertIn(old, text)
        docs["ecs.tf"] = hcl2.loads(text.replace(old, 'region_secrets = ["region_peer_database_url"]'), serialization_options=OPTIONS)
        problems = check_region_env(ROOT, Config(docs))
        for role in ROOT.variables["services"]["default"]:
            self.assertCaught(problems, f"module dr role {role}: no BOXOFFICE_WITNESS_DATABASE_URL secret")

if __name__ == "__main__":
    unittest.main()
