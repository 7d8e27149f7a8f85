"""Pictures of a dumped graph: DOT (the graph from networkx, fusion groups as clusters), SVG
when Graphviz's ``dot`` is installed, and one self-contained HTML page (no network, no
scripts from elsewhere) whose graph nodes link to their IR lines and kernel sources.

The HTML page lays the graph out itself, one horizontal band per kernel (inputs on top), so
it needs neither Graphviz nor a browser extension: a value a kernel recomputes is drawn in
every band that computes it.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

from flame.tools.recorder import DumpRecorder, GraphRecord

NODE_WIDTH, NODE_HEIGHT, GAP, LANE_PAD, LABEL_WIDTH = 150, 36, 18, 14, 230
WRAP = 8  # columns of a band before it wraps


def to_networkx(record: GraphRecord):
    """The processed graph as a ``networkx.DiGraph``: node attributes ``name``, ``op``,
    ``type``, ``site``, ``groups``; graph attribute ``groups`` (the kernels)."""
    import networkx

    picture = record.picture
    graph = networkx.DiGraph(groups=picture.groups)
    for node in picture.nodes:
        graph.add_node(node["id"], **{key: value for key, value in node.items() if key != "id"})
    graph.add_edges_from(picture.edges)
    return graph


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_dot(record: GraphRecord) -> str:
    """DOT text: one cluster per kernel (a recomputed value sits in its first kernel's
    cluster and says which others recompute it), inputs as ellipses."""
    graph = to_networkx(record)
    lines = [f"digraph {_dot_quote(record.title)} {{", "  rankdir=TB;", "  node [shape=box];"]
    placed = set()
    for group in graph.graph["groups"]:
        kernel = record.kernels[group["index"]]
        lines.append(f"  subgraph cluster_k{group['index']} {{")
        label = f"k{group['index']} {group['kind']}: {kernel.name}"
        url = f"#g{record.index}-k{group['index']}"
        lines.append(f"    label={_dot_quote(label)}; URL={_dot_quote(url)};")
        for node_id in group["nodes"]:
            if node_id in placed:
                continue
            placed.add(node_id)
            lines.append(f"    {node_id} [{_dot_node(graph.nodes[node_id])}];")
        lines.append("  }")
    for node_id, data in graph.nodes(data=True):
        if node_id not in placed:
            lines.append(f"  {node_id} [{_dot_node(data)}, shape=ellipse];")
    lines += [f"  {source} -> {target};" for source, target in graph.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_node(data: dict) -> str:
    label = f"{data['name']} = {data['op']}\\n{data['type']}"
    if len(data["groups"]) > 1:
        label += "\\nalso in " + " ".join(f"k{index}" for index in data["groups"][1:])
    label = label.replace('"', '\\"')
    tooltip = data["site"] or data["name"]
    return f'label="{label}", tooltip={_dot_quote(tooltip)}'


def render_svg(dot: str) -> str | None:
    """SVG from Graphviz's ``dot``, or None when it is not installed."""
    program = shutil.which("dot")
    if program is None:
        return None
    result = subprocess.run(
        [program, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        return None
    return result.stdout


# -- the HTML page ------------------------------------------------------------------------


def _layout(record: GraphRecord):
    """Boxes ``(copy id, node, x, y, kernel index | None)`` and bands ``(kernel, y, height)``:
    one band per kernel (inputs first, side by side); inside a band, columns by depth within
    the kernel, wrapped every ``WRAP`` columns so long chains stay on screen."""
    picture = record.picture
    by_id = {node["id"]: node for node in picture.nodes}
    inputs = [node["id"] for node in picture.nodes if node["input"]]
    lanes = [(None, inputs)] + [(group["index"], group["nodes"]) for group in picture.groups]
    parents: dict[str, list[str]] = {}
    for source, target in picture.edges:
        parents.setdefault(target, []).append(source)
    boxes, bands, y = [], [], GAP
    for kernel, members in lanes:
        if not members:
            continue
        member_set, depth = set(members), {}
        for position, node_id in enumerate(members):  # graph order: parents first
            if kernel is None:
                depth[node_id] = position
                continue
            inner = [depth[p] for p in parents.get(node_id, []) if p in member_set and p in depth]
            depth[node_id] = 1 + max(inner) if inner else 0
        cells: dict[tuple[int, int], int] = {}  # (block, column) -> rows used
        for node_id in members:
            block, column = divmod(depth[node_id], WRAP)
            cells[(block, column)] = cells.get((block, column), 0) + 1
        block_rows = {}
        for (block, _), rows in cells.items():
            block_rows[block] = max(block_rows.get(block, 0), rows)
        block_top, top = {}, y + LANE_PAD
        for block in sorted(block_rows):
            block_top[block] = top
            top += block_rows[block] * (NODE_HEIGHT + GAP) + GAP
        used: dict[tuple[int, int], int] = {}
        for node_id in members:
            block, column = divmod(depth[node_id], WRAP)
            row = used.get((block, column), 0)
            used[(block, column)] = row + 1
            x = LABEL_WIDTH + GAP + column * (NODE_WIDTH + GAP)
            box_y = block_top[block] + row * (NODE_HEIGHT + GAP)
            boxes.append((node_id, by_id[node_id], x, box_y, kernel))
        height = max(top - GAP - y + LANE_PAD - GAP, 2 * LANE_PAD + NODE_HEIGHT + 26)
        bands.append((kernel, y, height))
        y += height + GAP
    return boxes, bands, y


def _edge_paths(record: GraphRecord, boxes) -> list[str]:
    """Each edge drawn to every copy of its target, from the copy of its source that the
    target reads: the same kernel's, else the kernel that writes it, else the inputs."""
    copies: dict[str, dict] = {}
    for node_id, _, x, y, kernel in boxes:
        copies.setdefault(node_id, {})[kernel] = (x, y)
    writer = {out: group["index"] for group in record.picture.groups for out in group["outputs"]}
    paths = []
    for source, target in record.picture.edges:
        for kernel, (tx, ty) in copies.get(target, {}).items():
            options = copies.get(source, {})
            origin = options.get(kernel) or options.get(writer.get(source)) or options.get(None)
            if origin is None and options:
                origin = next(iter(options.values()))
            if origin is not None:
                paths.append(_edge(origin, (tx, ty)))
    return paths


def _edge(origin, target) -> str:
    (sx, sy), (tx, ty) = origin, target
    if sy == ty and tx > sx:  # side by side in one row: right edge to left edge
        sx, sy, tx, ty = sx + NODE_WIDTH, sy + NODE_HEIGHT / 2, tx, ty + NODE_HEIGHT / 2
        bend = (tx - sx) / 2
        curve = f"C{sx + bend:.0f},{sy:.0f} {tx - bend:.0f},{ty:.0f}"
    else:  # bottom edge to top edge
        sx, sy, tx = sx + NODE_WIDTH / 2, sy + NODE_HEIGHT, tx + NODE_WIDTH / 2
        bend = max(30.0, abs(ty - sy) / 2)
        curve = f"C{sx:.0f},{sy + bend:.0f} {tx:.0f},{ty - bend:.0f}"
    return f'<path class="edge" d="M{sx:.0f},{sy:.0f} {curve} {tx:.0f},{ty:.0f}"/>'


def graph_svg(record: GraphRecord) -> str:
    boxes, bands, height = _layout(record)
    columns = max((x for _, _, x, _, _ in boxes), default=LABEL_WIDTH) + NODE_WIDTH + GAP
    prefix = f"g{record.index}"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{columns:.0f}" height="{height}" '
             f'class="graph" id="{prefix}-svg">']  # fmt: skip
    for kernel, y, band_height in bands:
        if kernel is None:
            title, href, css = "inputs", "", "band inputs"
        else:
            info = record.kernels[kernel]
            title, href, css = f"k{kernel} {info.kind}", f"#{prefix}-k{kernel}", "band"
        parts.append(
            f'<g class="{css}" data-kernel="{"" if kernel is None else f"k{kernel}"}">'
            f'<rect x="4" y="{y}" width="{columns - 8:.0f}" height="{band_height}" rx="8"/>'
        )
        label = f'<text x="14" y="{y + 22}" class="bandlabel">{html.escape(title)}</text>'
        if href:
            label = f'<a href="{href}">{label}</a>'
            sub = html.escape(record.kernels[kernel].label)
            label += f'<text x="14" y="{y + 40}" class="bandsub">{sub}</text>'
        parts.append(label + "</g>")
    parts += _edge_paths(record, boxes)
    for node_id, node, x, y, kernel in boxes:
        target = f"#{prefix}-k{kernel}" if kernel is not None else f"#{prefix}-ir"
        written = kernel is not None and node_id in record.picture.groups[kernel]["outputs"]
        css = "node input" if node["input"] else ("node written" if written else "node")
        tip = f"{node['name']}: {node['type']} = {node['op']}  {node['site']}".strip()
        parts.append(
            f'<a href="{target}"><g class="{css}" data-node="{node_id}" data-graph="{prefix}" '
            f'data-kernel="{"" if kernel is None else f"k{kernel}"}"><title>{html.escape(tip)}'
            f'</title><rect x="{x}" y="{y}" width="{NODE_WIDTH}" height="{NODE_HEIGHT}" rx="5"/>'
            f'<text x="{x + 8}" y="{y + 15}">{html.escape(node["name"])} '
            f'{html.escape(node["op"][:14])}</text><text x="{x + 8}" y="{y + 29}" class="type">'
            f"{html.escape(node['type'][:22])}</text></g></a>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


_IR_LINE = re.compile(r"^\s+(%\d+):")


def _ir_html(record: GraphRecord) -> str:
    ids = {node["name"]: node["id"] for node in record.picture.nodes}
    prefix = f"g{record.index}"
    lines = []
    for line in record.final.splitlines():
        match = _IR_LINE.match(line)
        node_id = ids.get(match.group(1)) if match else None
        attribute = f' id="{prefix}-{node_id}" data-node="{node_id}"' if node_id else ""
        lines.append(f'<span class="line"{attribute}>{html.escape(line)}</span>')
    return "\n".join(lines)


def _graph_section(record: GraphRecord, bandwidth: float) -> str:
    from flame.tools.dumpfiles import kernel_notes

    prefix = f"g{record.index}"
    parts = [
        f'<section class="graph-section" id="{prefix}">',
        f"<h2>{html.escape(record.title)} <small>({record.backend}; {len(record.kernels)} "
        f"kernels; {html.escape(record.plan_reason)}; plan-cache hits {record.hits})</small></h2>",
        f'<div class="picture">{graph_svg(record)}</div>',
        '<div class="columns"><div class="column">',
        f'<h3 id="{prefix}-ir">IR after all passes</h3><pre class="ir">{_ir_html(record)}</pre>',
        "<h3>IR after each pass</h3>",
    ]
    for name, seconds, text in record.passes:
        parts.append(
            f"<details><summary>{html.escape(name)} ({seconds * 1e3:.3f} ms)</summary>"
            f"<pre>{html.escape(text)}</pre></details>"
        )
    parts.append('</div><div class="column"><h3>Kernels</h3>')
    for kernel in record.kernels:
        notes = "\n".join(kernel_notes(kernel, record, bandwidth))
        body = html.escape(notes)
        if kernel.source is not None:
            body += "\n\n" + html.escape(kernel.source)
        parts.append(
            f'<details class="kernel" id="{prefix}-k{kernel.index}"><summary>k{kernel.index} '
            f"{html.escape(kernel.kind)}: {html.escape(kernel.name)}</summary>"
            f"<pre>{body}</pre></details>"
        )
    parts.append("</div></div></section>")
    return "\n".join(parts)


_STYLE = """
body { font: 14px/1.4 sans-serif; margin: 0 16px 40px; color: #1d1d1f; }
pre.summary { white-space: pre-wrap; }
pre { font: 12px/1.35 monospace; background: #f6f6f8; padding: 8px; overflow-x: auto; }
.picture { overflow-x: auto; border: 1px solid #ddd; }
svg.graph text { font: 11px monospace; fill: #222; }
svg.graph .bandlabel { font: bold 13px sans-serif; fill: #333; }
svg.graph .bandsub { font: 11px sans-serif; fill: #666; }
.band rect { fill: #eef3fb; stroke: #9db4d8; }
.band.inputs rect { fill: #f4f4f4; stroke: #bbb; }
.node rect { fill: #fff; stroke: #4a6fa5; }
.node.written rect { fill: #dff0d8; stroke: #3c763d; }
.node.input rect { fill: #fcf8e3; stroke: #8a6d3b; }
.node.hl rect, .line.hl { outline: 3px solid #e8590c; background: #ffe8cc; }
.edge { fill: none; stroke: #8896a8; stroke-width: 1.2; }
.columns { display: flex; gap: 16px; } .column { flex: 1; min-width: 0; }
.status { padding: 8px; background: #fde2e1; border: 1px solid #e0a0a0; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: right; }
"""

_SCRIPT = """
function openTarget() {  // index.html#g1-k2 opens that kernel's source
  var target = location.hash && document.getElementById(location.hash.slice(1));
  if (target && target.tagName === 'DETAILS') { target.open = true; }
}
window.addEventListener('hashchange', openTarget);
openTarget();
document.querySelectorAll('svg .node').forEach(function (node) {
  node.addEventListener('click', function () {
    document.querySelectorAll('.hl').forEach(function (x) { x.classList.remove('hl'); });
    var graph = node.dataset.graph, id = node.dataset.node;
    document.querySelectorAll('[data-node="' + id + '"]').forEach(function (x) {
      if (x.closest('#' + graph)) { x.classList.add('hl'); }
    });
    if (node.dataset.kernel) {
      var details = document.getElementById(graph + '-' + node.dataset.kernel);
      if (details) { details.open = true; }
    }
  });
});
"""


def render_html(recorder: DumpRecorder, status: dict) -> str:
    from flame.tools.dumpfiles import summary_text

    summary = summary_text(recorder, status, None, detail=False)
    navigation = " ".join(
        f'<a href="#g{record.index}">{html.escape(record.title)}</a>' for record in recorder.graphs
    )
    banner = ""
    if not status.get("complete", True):
        banner = f'<p class="status">{html.escape(status.get("reason", "incomplete"))}</p>'
    sections = "\n".join(_graph_section(record, recorder.bandwidth) for record in recorder.graphs)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>FLAME dump</title><style>{_STYLE}</style></head><body>"
        f'<h1>FLAME dump</h1>{banner}<pre class="summary">{html.escape(summary)}</pre>'
        f"<nav>{navigation}</nav>{sections}<script>{_SCRIPT}</script></body></html>\n"
    )
