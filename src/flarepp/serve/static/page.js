// flarepp serve's page: upload a mesh, set the conditions, see the predicted fields in 3-D.
// The server's mesh endpoint returns the outer surface as VTK XML (.vtp) with pred_<field>
// arrays and a JSON summary header; vtk.js (served beside this file) draws it with a colour
// bar. <body data-state> says "ready", "busy", "shown" or "error" (the browser test waits on it).
"use strict";

const $ = (id) => document.getElementById(id);
const view = { summary: null, polydata: null };

function authHeaders() {
  const token = $("token").value.trim();
  return token ? { Authorization: "Bearer " + token } : {};
}

function say(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
  if (error) document.body.dataset.state = "error";
}

async function getJSON(url) {
  const response = await fetch(url, { headers: authHeaders() });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// -- the scene: a render window, one actor, a colour bar --------------------------------------
const scene = (() => {
  const window3d = vtk.Rendering.Misc.vtkGenericRenderWindow.newInstance({
    background: [1, 1, 1] });
  window3d.setContainer($("view"));
  const mapper = vtk.Rendering.Core.vtkMapper.newInstance();
  const actor = vtk.Rendering.Core.vtkActor.newInstance();
  actor.setMapper(mapper);
  const lut = vtk.Rendering.Core.vtkColorTransferFunction.newInstance();
  lut.applyColorMap(vtk.Rendering.Core.vtkColorTransferFunction.vtkColorMaps
    .getPresetByName("Cool to Warm"));
  const bar = vtk.Rendering.Core.vtkScalarBarActor.newInstance();
  bar.setScalarsToColors(lut);
  bar.setAxisTextStyle({ fontColor: "black" });
  bar.setTickTextStyle({ fontColor: "black" });
  bar.setDrawNanAnnotation(false);
  const renderer = window3d.getRenderer();
  window3d.resize();
  window.addEventListener("resize", () => window3d.resize());
  return { window3d, mapper, actor, lut, bar, renderer };
})();

// a store without units says "units not given": no brackets then
const unitsOf = (summary) => (summary.units === "units not given" ? "" : summary.units);

function colourBy(name) {
  const { summary, polydata } = view;
  const arrayName = "pred_" + name;
  const cells = summary.association === "cell";
  const data = cells ? polydata.getCellData() : polydata.getPointData();
  const array = data.getArrayByName(arrayName);
  if (!array) { say(`the mesh came back without the array ${arrayName}`, true); return; }
  const [low, high] = array.getRange();
  scene.lut.setMappingRange(low, high === low ? low + 1 : high);
  scene.lut.updateRange();
  const { ScalarMode, ColorMode } = vtk.Rendering.Core.vtkMapper;
  scene.mapper.set({
    colorByArrayName: arrayName, scalarVisibility: true, colorMode: ColorMode.MAP_SCALARS,
    scalarMode: cells ? ScalarMode.USE_CELL_FIELD_DATA : ScalarMode.USE_POINT_FIELD_DATA,
    useLookupTableScalarRange: true, interpolateScalarsBeforeMapping: !cells });
  scene.mapper.setLookupTable(scene.lut);
  scene.bar.setAxisLabel(unitsOf(summary) ? `${name} [${unitsOf(summary)}]` : name);
  scene.window3d.getRenderWindow().render();
}

function showNumbers(summary) {
  const rows = [[summary.association === "cell" ? "cells" : "points", String(summary.rows)]];
  for (const [name, [low, high]] of Object.entries(summary.fields)) {
    rows.push([`${name} range`, `${low.toPrecision(6)} .. ${high.toPrecision(6)}`]);
  }
  if (summary.force) {
    rows.push(["force (x, y, z)", summary.force.map((v) => v.toPrecision(6)).join(", ")]);
  }
  rows.push(["seconds", summary.seconds.toFixed(3)]);
  $("numbers").replaceChildren(...rows.flatMap(([key, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = key;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dd.dataset.key = key;
    return [dt, dd];
  }));
}

function show(buffer, summary) {
  const reader = vtk.IO.XML.vtkXMLPolyDataReader.newInstance();
  reader.parseAsArrayBuffer(buffer);
  view.polydata = reader.getOutputData(0);
  view.summary = summary;
  scene.mapper.setInputData(view.polydata);
  if (!scene.renderer.getActors().includes(scene.actor)) {
    scene.renderer.addActor(scene.actor);
    scene.renderer.addActor(scene.bar);
  }
  const fields = Object.keys(summary.fields);
  $("field").replaceChildren(...fields.map((name) => new Option(name, name)));
  $("field").disabled = false;
  colourBy(fields[0]);
  scene.renderer.resetCamera();
  const bounds = view.polydata.getBounds();
  if (bounds[5] > bounds[4]) {                // a 3-D body: an oblique view
    scene.renderer.getActiveCamera().elevation(25);
    scene.renderer.getActiveCamera().azimuth(-35);
    scene.renderer.resetCamera();
  }
  scene.window3d.getRenderWindow().render();
  showNumbers(summary);
}

async function predict() {
  const file = $("mesh").files[0];
  if (!file) { say("choose a geometry or mesh file first", true); return; }
  const conditions = {};
  for (const input of $("conditions").querySelectorAll("input")) {
    if (input.value.trim() !== "") conditions[input.name] = Number(input.value);
  }
  const form = new FormData();
  form.append("mesh", file, file.name);
  form.append("conditions", JSON.stringify(conditions));
  document.body.dataset.state = "busy";
  say(`predicting ${file.name} ...`);
  const model = $("model").value;
  const response = await fetch(`/v2/models/${encodeURIComponent(model)}/mesh?surface=true`,
    { method: "POST", headers: authHeaders(), body: form });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    say(body.error || `the server answered ${response.status}`, true);
    return;
  }
  const summary = JSON.parse(response.headers.get("Flarepp-Summary"));
  show(await response.arrayBuffer(), summary);
  say(`${file.name}: ${summary.rows} ${summary.association}s predicted by ${model}`);
  document.body.dataset.state = "shown";
}

async function chooseModel() {
  const layout = (await getJSON(`/v2/models/${encodeURIComponent($("model").value)}`))
    .parameters.layout;
  $("about").textContent = `${layout.task} run: fields ${layout.field_names.join(", ")}` +
    (unitsOf(layout) ? ` [${unitsOf(layout)}]` : "") +
    (layout.mesh === "supported" ? "" : `; no mesh input: ${layout.mesh}`);
  const names = layout.conditions ? layout.condition_names : [];
  $("conditions").replaceChildren(...names.flatMap((name) => {
    const label = document.createElement("label");
    label.textContent = `condition ${name}`;
    const input = document.createElement("input");
    input.type = "number";
    input.step = "any";
    input.name = name;
    input.placeholder = "from the file's field data";
    return [label, input];
  }));
}

async function start() {
  try {
    const { models } = await getJSON("/v2/models");
    const chosen = $("model").value;                 // kept when the list is read again
    $("model").replaceChildren(...models.map((name) => new Option(name, name)));
    if (models.includes(chosen)) $("model").value = chosen;
    await chooseModel();
    document.body.dataset.state = "ready";
    say("ready");
  } catch (err) {
    say(`${err.message} (a token? type it, then choose the model again)`, true);
  }
}

$("model").addEventListener("change", () => chooseModel().catch((e) => say(e.message, true)));
$("predict").addEventListener("click", () => predict().catch((e) => say(e.message, true)));
$("field").addEventListener("change", () => colourBy($("field").value));
$("token").addEventListener("change", start);
start();
