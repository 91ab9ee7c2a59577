/*
 * sim_html.c — the simulator's HTML report: the comparison table, the SVG
 * of sim_plot.c and per-layer bars (declared in ferry_tools.h;
 * docs/sim-outputs.md, "Outputs").
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "sim/sim_format.h"
#include "sim/sim_plot.h"

#define GB 1e9

static const char html_style[] =
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:1150px}\n"
    "h1{font-size:22px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 8px}\n"
    "p{margin:4px 0;font-size:14px;max-width:900px}.meta{color:#555;font-size:13px}\n"
    "table{border-collapse:collapse;font-size:13px}\n"
    "th,td{padding:3px 7px;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}\n"
    "th{background:#f4f4f4;white-space:normal;vertical-align:bottom}"
    "td.name,th.name{text-align:left}\n"
    ".sw{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:-1px}\n"
    ".bar{display:inline-block;height:12px;background:#e3e3e3;vertical-align:-1px;"
    "border-radius:2px;overflow:hidden;white-space:nowrap;font-size:0}\n"
    ".bar span{display:inline-block;height:12px}\n"
    "td.cell{text-align:left}td.cell small{color:#555;margin-left:6px;font-size:11px}\n"
    "pre{font-size:12px;background:#f8f8f8;padding:10px;overflow-x:auto}\n"
    ".bad{color:#b00;font-weight:bold}\n"
    "small.band{display:block;color:#666;font-size:11px}\n";

/* Under a policy's memory saved or overhead: its error band in points on
 * published runs like this one; the whole sentence on hover. */
static void html_band(FILE *f, const sim_run_info *info, const sim_result *rs, int i, int figure) {
  sim_run_class c;
  sim_run_class_of(info, rs, i, &c);
  sim_band b;
  sim_band_pick(&c, figure, &b);
  double b0 = (double)rs[0].peak_device_bytes;
  double value = figure == SIM_BAND_OVERHEAD ? c.overhead_pct
                 : b0 > 0                    ? 100.0 * (b0 - (double)rs[i].peak_device_bytes) / b0
                                             : 0;
  char text[384];
  sim_band_text(&b, figure, value, text, sizeof text);
  fprintf(f, "<small class=\"band\" data-figure=\"%s\" ",
          figure == SIM_BAND_MEMORY ? "memory" : "overhead");
  if (b.runs) fprintf(f, "data-points=\"%.1f,%.1f\" ", b.lo, b.hi); /* none: no band */
  fprintf(f, "data-runs=\"%d\" title=\"", b.runs);
  xml_text(f, text);
  if (!b.runs) {
    fputs("\">no band<br/>not validated</small>", f);
    return;
  }
  fprintf(f, "\">%+.1f to %+.1f pts<br/>%s%d run%s, %d publication%s</small>", b.lo, b.hi,
          b.all ? "all " : "", b.runs, b.runs == 1 ? "" : "s", b.publications,
          b.publications == 1 ? "" : "s");
}

/* The comparison table, the columns of the text report's. */
static void html_table(FILE *f, const sim_run_info *info, const sim_result *rs, int n) {
  static const char *const heads[] = {"peak device", "reduction", "step", "overhead", "stall",
                                      "D2H / step", "H2D / step", "host peak", "host reserved",
                                      "offloaded", "kept", "policy errors", "fits"};
  fputs("<table class=\"runs\">\n<thead><tr><th class=\"name\">policy</th>", f);
  for (size_t k = 0; k < sizeof heads / sizeof heads[0]; k++) fprintf(f, "<th>%s</th>", heads[k]);
  fputs("</tr></thead>\n<tbody>\n", f);
  for (int i = 0; i < n; i++) {
    const sim_result *r = &rs[i];
    sim_row_cells c;
    sim_row_format(r, &c);
    char red[16], ovh[16];
    double b0 = (double)rs[0].peak_device_bytes;
    if (i == 0 || b0 <= 0) snprintf(red, sizeof red, "-");
    else snprintf(red, sizeof red, "%.1f%%", 100.0 * (b0 - (double)r->peak_device_bytes) / b0);
    if (i == 0 || rs[0].step_us <= 0) snprintf(ovh, sizeof ovh, "-");
    else snprintf(ovh, sizeof ovh, "%+.1f%%", 100.0 * (r->step_us - rs[0].step_us) / rs[0].step_us);
    int fits = info->hw && info->hw->device_bytes > 0
                   ? (double)r->peak_device_bytes <= sim_hw_usable_bytes(info->hw) : -1;
    fputs("<tr data-run=\"", f);
    xml_text(f, r->label);
    fprintf(f, "\"><td class=\"name\"><span class=\"sw\" style=\"background:%s\"></span>",
            run_color(i));
    xml_text(f, r->label);
    fprintf(f, "</td><td>%s</td><td>%s", c.peak, red);
    if (i > 0) html_band(f, info, rs, i, SIM_BAND_MEMORY);
    fprintf(f, "</td><td>%s</td><td>%s", c.step, ovh);
    if (i > 0) html_band(f, info, rs, i, SIM_BAND_OVERHEAD);
    fprintf(f, "</td><td>%s</td><td>%s</td>"
               "<td>%s</td><td>%s</td><td>%s</td><td>%.0f</td><td>%.0f</td><td%s>%llu</td>"
               "<td%s>%s</td></tr>\n",
            c.stall, c.d2h, c.h2d, c.host_peak, c.host_reserved,
            r->tensors_offloaded, r->tensors_kept,
            r->policy_errors ? " class=\"bad\"" : "", (unsigned long long)r->policy_errors,
            fits == 0 ? " class=\"bad\"" : "", fits < 0 ? "?" : fits ? "yes" : "no");
  }
  fputs("</tbody>\n</table>\n", f);
}

/* Whether layer rows k and j (indices) hold the same bytes in every run. */
static int same_layer_bytes(const sim_result *rs, int n, uint32_t k, uint32_t j) {
  for (int i = 0; i < n; i++) {
    if (k >= rs[i].n_layers || j >= rs[i].n_layers) return 0;
    const sim_layer_row *a = &rs[i].layers[k], *b = &rs[i].layers[j];
    if (a->saved_bytes != b->saved_bytes || a->offloaded_bytes != b->offloaded_bytes) return 0;
  }
  return 1;
}

/* Per layer of the last step, per policy: a bar as long as the layer's
 * saved bytes, the offloaded part in the policy's colour, the kept part
 * grey. Consecutive layers with the same bytes in every run share a row. */
static void html_layers(FILE *f, const sim_result *rs, int n) {
  double most = 0;
  for (uint32_t k = 0; k < rs[0].n_layers; k++)
    if ((double)rs[0].layers[k].saved_bytes > most) most = (double)rs[0].layers[k].saved_bytes;
  if (n < 2 || most <= 0) {
    fputs("<p>No policy run, or nothing saved for backward: no per-layer bars.</p>\n", f);
    return;
  }
  fputs("<p>Bytes saved for backward in each layer during the last step; for each policy the "
        "part it offloaded (its colour) and the part it kept on the device (grey). A bar's "
        "length is the layer's saved bytes against the largest layer's. Consecutive layers "
        "with the same figures share a row (the figures are per layer); hover a bar for the "
        "exposed reload stall.</p>\n", f);
  fputs("<table class=\"layers\">\n<thead><tr><th class=\"name\">layer</th><th>saved</th>", f);
  for (int i = 1; i < n; i++) {
    fprintf(f, "<th class=\"name\"><span class=\"sw\" style=\"background:%s\"></span>",
            run_color(i));
    xml_text(f, rs[i].label);
    fputs(": offloaded / kept</th>", f);
  }
  fputs("</tr></thead>\n<tbody>\n", f);
  for (uint32_t k = 0; k < rs[0].n_layers;) {
    const sim_layer_row *b = &rs[0].layers[k];
    uint32_t last = k;
    if (b->layer >= 0)
      while (last + 1 < rs[0].n_layers && rs[0].layers[last + 1].layer >= 0 &&
             rs[0].layers[last + 1].packed && same_layer_bytes(rs, n, k, last + 1))
        last++;
    uint32_t next = last + 1;
    if (!b->packed) {
      k = next;
      continue;
    }
    char lab[64], sv[32];
    if (b->layer < 0) snprintf(lab, sizeof lab, "outside layers");
    else if (last > k) snprintf(lab, sizeof lab, "%d\u2013%d", b->layer, rs[0].layers[last].layer);
    else snprintf(lab, sizeof lab, "%d", b->layer);
    fmt_bytes(sv, sizeof sv, (double)b->saved_bytes);
    fprintf(f, "<tr data-layer=\"%d\" data-layers=\"%u\"><td class=\"name\">%s</td><td>%s%s</td>",
            b->layer, last - k + 1, lab, sv, last > k ? " each" : "");
    for (int i = 1; i < n; i++) {
      const sim_layer_row *l = k < rs[i].n_layers ? &rs[i].layers[k] : NULL;
      double saved = l ? (double)l->saved_bytes : 0, off = l ? (double)l->offloaded_bytes : 0;
      double kept = saved > off ? saved - off : 0, stall = 0;
      for (uint32_t j = k; j <= last && j < rs[i].n_layers; j++) stall += rs[i].layers[j].stall_us;
      double len = 160.0 * saved / most;
      char ob[32], kb[32], stl[32];
      fmt_bytes(ob, sizeof ob, off);
      fmt_bytes(kb, sizeof kb, kept);
      fmt_us(stl, sizeof stl, stall);
      fputs("<td class=\"cell\" data-run=\"", f);
      xml_text(f, rs[i].label);
      fprintf(f, "\" data-offloaded=\"%.0f\" data-kept=\"%.0f\"><span class=\"bar\" "
                 "style=\"width:%.1fpx\" title=\"",
              off, kept, len < 1 && saved > 0 ? 1 : len);
      xml_text(f, rs[i].label);
      fprintf(f, ", layer %s: %s offloaded, %s kept%s; reload stall %s%s\">"
                 "<span style=\"width:%.1fpx;background:%s\"></span></span>"
                 "<small>%s / %s</small></td>",
              lab, ob, kb, last > k ? " per layer" : "", stl, last > k ? " in all" : "",
              saved > 0 ? len * off / saved : 0, run_color(i), ob, kb);
    }
    fputs("</tr>\n", f);
    k = next;
  }
  fputs("</tbody>\n</table>\n", f);
}

int sim_write_html(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                   char *err, size_t errlen) {
  /* the text report, as `ferry sim` prints it */
  char *text = NULL;
  size_t len = 0;
  FILE *m = open_memstream(&text, &len);
  if (!m) {
    snprintf(err, errlen, "out of memory writing %s", path);
    return -1;
  }
  sim_print_table(m, info, rs, n);
  sim_print_layers(m, rs, n);
  fclose(m);
  FILE *f = fopen(path, "w");
  if (!f) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    free(text);
    return -1;
  }
  const char *hw = info->hw ? info->hw->name : "?";
  const char *trace = info->trace_path ? info->trace_path : "trace";
  fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>ferry sim: ",
        f);
  xml_text(f, trace);
  fprintf(f, " on %s</title>\n<style>\n%s</style>\n</head>\n<body>\n<h1>ferry sim: ", hw,
          html_style);
  xml_text(f, trace);
  fprintf(f, " on %s</h1>\n", hw);
  if (info->trace && info->hw) {
    char res[32];
    fmt_bytes(res, sizeof res, (double)info->trace->resident_bytes);
    fprintf(f, "<p class=\"meta\">%d layers, %s resident; link H2D %.1f GB/s, D2H %.1f GB/s, "
               "%.1f us per copy, device %.0f GB; %u steps replayed, figures per steady step "
               "(after %u warm-up step(s)). The first row keeps everything on the device.</p>\n",
            info->trace->layers, res, sim_info_link(info, 1) / GB,
            sim_info_link(info, 0) / GB, info->hw->link.latency_us,
            info->hw->device_bytes / GB, n ? rs[0].steps : 0,
            n && rs[0].warmup < rs[0].steps ? rs[0].warmup : 0);
  }
  fputs("<h2>Comparison</h2>\n", f);
  html_table(f, info, rs, n);
  if (n > 1)
    fputs("<p>Under each memory saving and overhead: the simulator's error (simulated \u2212 "
          "published, in points) on the published runs like this one, from docs/sim-validation.md's "
          "\"Validation: memory and cost\"; hover it for which runs and where a real run like "
          "them landed (the text report below says the same).</p>\n", f);
  fputs("<p>Where the device peak falls (last step):</p>\n<ul>\n", f);
  for (int i = 0; i < n; i++) {
    char where[256];
    sim_peak_where_text(&rs[i], where, sizeof where);
    fputs("<li>", f);
    xml_text(f, rs[i].label);
    fputs(": ", f);
    xml_text(f, where);
    fputs("</li>\n", f);
  }
  fputs("</ul>\n", f);
  fputs("<h2>Memory over one step</h2>\n<div class=\"figure\">\n", f);
  svg_write(f, info, rs, n, 1);
  fputs("</div>\n<h2>Per layer, last step</h2>\n", f);
  html_layers(f, rs, n);
  fputs("<h2>Text report</h2>\n<pre>", f);
  xml_text(f, text ? text : "");
  fputs("</pre>\n</body>\n</html>\n", f);
  free(text);
  return close_checked(f, path, err, errlen);
}
