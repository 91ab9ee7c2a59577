/*
 * sim_plot.c — the simulator's pictures: memory over one step as an SVG,
 * and the HTML report that carries it with the comparison table and
 * per-layer bars (declared in ferry_tools.h; docs/sim-outputs.md, "Outputs").
 *
 * The SVG is laid out for a reader: the legend below the plot, the peaks
 * annotated where no other text is (every label's box is estimated and
 * kept apart from the others), a right axis for pinned host memory and a
 * strip per run of the intervals its compute waited. The elements carry
 * classes and data-* attributes (tests/cli/test_sim_plots.py reads them).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "sim/sim_format.h"
#include "sim/sim_plot.h"

#define GB 1e9
#define MIB 1048576.0
#define MAX_BOXES 1024

static const char *const colors[] = {"#555555", "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e",
                                     "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"};

const char *run_color(int i) { return colors[i % 10]; }

/* ---- text ---------------------------------------------------------------------------- */

/* Whether the n bytes at s start with a well-formed UTF-8 sequence; its length. */
static int utf8_len(const unsigned char *s) {
  int n = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
  for (int k = 1; k < n; k++)
    if ((s[k] & 0xc0) != 0x80) return 0;
  return n;
}

/* s as XML character data or an attribute value: markup escaped, control
 * characters and bytes that are not UTF-8 as '?'. */
void xml_text(FILE *f, const char *str) {
  const unsigned char *s = (const unsigned char *)str;
  while (*s) {
    unsigned c = *s;
    if (c >= 0x80) {
      int n = utf8_len(s);
      if (n) {
        fwrite(s, 1, (size_t)n, f);
        s += n;
      } else {
        fputc('?', f);
        s++;
      }
      continue;
    }
    if (c == '<') fputs("&lt;", f);
    else if (c == '>') fputs("&gt;", f);
    else if (c == '&') fputs("&amp;", f);
    else if (c == '"') fputs("&quot;", f);
    else if (c < 0x20 && c != '\n' && c != '\t') fputc('?', f);
    else fputc((int)c, f);
    s++;
  }
}

/* The width of s in px at font size fs, estimated for a sans-serif face a
 * little wide rather than narrow (the test script has the same rule). */
static double text_w(const char *str, double fs) {
  double w = 0;
  for (const unsigned char *s = (const unsigned char *)str; *s; s++) {
    unsigned c = *s;
    if ((c & 0xc0) == 0x80) continue; /* inside a UTF-8 sequence */
    if (c >= 0x80) w += 0.9;
    else if (strchr("il.,:;'|!Ijft()[] ", (int)c)) w += 0.34;
    else if (strchr("mwMW%@", (int)c)) w += 0.95;
    else if (c >= 'A' && c <= 'Z') w += 0.72;
    else if (c >= '0' && c <= '9') w += 0.64;
    else w += 0.58;
  }
  return w * fs;
}

/* s into dst, shortened with "..." to be at most max_px wide at font size fs. */
static void fit_text(char *dst, size_t n, const char *s, double max_px, double fs) {
  snprintf(dst, n, "%s", s);
  while (text_w(dst, fs) > max_px && strlen(dst) > 4) strcpy(dst + strlen(dst) - 4, "...");
}

/* ---- the SVG's layout ---------------------------------------------------------------- */

typedef struct box {
  double x0, y0, x1, y1;
} box;

static int overlaps(box a, box b) {
  return a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1;
}

enum { START, MIDDLE, END };

/* Text at (x, y) (baseline) anchored at its start, middle or end. */
static box text_box(double x, double y, const char *s, double fs, int anchor) {
  double w = text_w(s, fs);
  double x0 = anchor == START ? x : anchor == MIDDLE ? x - w / 2 : x - w;
  return (box){x0, y - 0.8 * fs, x0 + w, y + 0.25 * fs};
}

typedef struct svg {
  FILE *f;
  int W, H;           /* canvas */
  int L, R, T, B;     /* the plot area: left, right, top, bottom */
  int sT, sB, row;    /* the stall strip: top, bottom, a run's row height */
  int legend_y;       /* the legend's first baseline */
  double tms, xs;     /* time axis end and tick step, ms */
  double yg, ys;      /* device axis (left) end and step, in units of ydiv */
  double hg, hs;      /* pinned host axis (right) end and step, in units of hdiv */
  double ydiv, hdiv;  /* bytes per unit: GiB, or MiB below 1 GiB */
  double cap;         /* device capacity, bytes (0: unknown) */
  box used[MAX_BOXES]; /* text and markers placed so far */
  int n_used;
  /* the plot area in cells of OCC px: 1 where a solid or dashed line is
   * drawn (curves, the capacity), so labels keep off them (a dotted line
   * shows through a label's halo) */
  uint8_t *occ;
  int occ_w, occ_h;
  box leaders[MAX_BOXES]; /* leader lines drawn: (x0, y0) to (x1, y1) */
  int n_leaders;
  double marks[MAX_BOXES][2]; /* the peak markers' centres */
  int n_marks;
} svg;

#define OCC 3

/* The cells of the axis-aligned segment (x0, y0)-(x1, y1) as drawn on. */
static void occupy(svg *p, double x0, double y0, double x1, double y1) {
  if (!p->occ) return;
  int a = (int)floor((fmin(x0, x1) - p->L) / OCC), b = (int)floor((fmax(x0, x1) - p->L) / OCC);
  int c = (int)floor((fmin(y0, y1) - p->T) / OCC), d = (int)floor((fmax(y0, y1) - p->T) / OCC);
  if (a < 0) a = 0;
  if (c < 0) c = 0;
  if (b >= p->occ_w) b = p->occ_w - 1;
  if (d >= p->occ_h) d = p->occ_h - 1;
  for (int y = c; y <= d; y++)
    for (int x = a; x <= b; x++) p->occ[y * p->occ_w + x] = 1;
}

/* How many cells of box b a line is drawn in (0: none crosses it). */
static int box_on_line(const svg *p, box b) {
  if (!p->occ) return 0;
  int a = (int)floor((b.x0 - p->L) / OCC), e = (int)floor((b.x1 - p->L) / OCC);
  int c = (int)floor((b.y0 - p->T) / OCC), d = (int)floor((b.y1 - p->T) / OCC);
  if (a < 0) a = 0;
  if (c < 0) c = 0;
  if (e >= p->occ_w) e = p->occ_w - 1;
  if (d >= p->occ_h) d = p->occ_h - 1;
  int n = 0;
  for (int y = c; y <= d; y++)
    for (int x = a; x <= e; x++) n += p->occ[y * p->occ_w + x];
  return n;
}

static void keep_box(svg *p, box b) {
  if (p->n_used < MAX_BOXES) p->used[p->n_used++] = b;
}

static int box_free(const svg *p, box b) {
  for (int i = 0; i < p->n_used; i++)
    if (overlaps(b, p->used[i])) return 0;
  return 1;
}

/* A text element (escaped) whose box is kept clear of later labels. */
static void label(svg *p, double x, double y, double fs, int anchor, const char *fill,
                  const char *cls, const char *s) {
  static const char *const anchors[3] = {"start", "middle", "end"};
  fprintf(p->f, "<text x=\"%.1f\" y=\"%.1f\"", x, y);
  if (fs != 12) fprintf(p->f, " font-size=\"%g\"", fs);
  if (anchor != START) fprintf(p->f, " text-anchor=\"%s\"", anchors[anchor]);
  if (fill) fprintf(p->f, " fill=\"%s\"", fill);
  if (cls) fprintf(p->f, " class=\"%s\"", cls);
  fputc('>', p->f);
  xml_text(p->f, s);
  fputs("</text>\n", p->f);
  keep_box(p, text_box(x, y, s, fs, anchor));
}

/* The smallest of 1, 2, 2.5, 5 x 10^k not below x. */
static double nice_ceil(double x) {
  double mag = pow(10, floor(log10(x))), f = x / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
}

static double nice_step(double range, int ticks) {
  double raw = range / ticks, mag = pow(10, floor(log10(raw))), f = raw / mag;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

static double px_t(const svg *p, double ms) { return p->L + ms / p->tms * (p->R - p->L); }
static double py_dev(const svg *p, double bytes) {
  return p->B - bytes / p->ydiv / p->yg * (p->B - p->T);
}
static double py_host(const svg *p, double bytes) {
  return p->B - bytes / p->hdiv / p->hg * (p->B - p->T);
}

/* The largest sample of a run's timeline series and its time, -1 if none. */
static double series_peak(const sim_mem_sample *s, size_t n, double *at) {
  double best = -1;
  for (size_t k = 0; k < n; k++)
    if ((double)s[k].bytes > best) {
      best = (double)s[k].bytes;
      *at = s[k].t;
    }
  return best;
}

/* Runs with pinned host memory at some point of their step. */
static double host_max(const sim_result *r) {
  double at = 0, m = series_peak(r->tl.host, r->tl.n_host, &at);
  return m > (double)r->peak_host_bytes ? m : (double)r->peak_host_bytes;
}

/* Scales and the canvas: the axes reach the longest step, the highest
 * memory (the capacity when it is not far above), the most pinned memory;
 * the right axis has the left one's ticks. */
static void svg_layout(svg *p, const sim_run_info *info, const sim_result *rs, int n) {
  p->W = 1100;
  p->L = 128;
  p->R = p->W - 96;
  p->T = 66;
  p->B = p->T + 360;
  p->row = 16;
  double tmax = 0, ymax = 0, hmax = 0;
  for (int i = 0; i < n; i++) {
    const sim_timeline *tl = &rs[i].tl;
    double d = tl->t_end - tl->t_begin, at;
    if (d > tmax) tmax = d;
    double m = series_peak(tl->mem, tl->n_mem, &at);
    if (m > ymax) ymax = m;
    if ((double)rs[i].peak_device_bytes > ymax) ymax = (double)rs[i].peak_device_bytes;
    m = host_max(&rs[i]);
    if (m > hmax) hmax = m;
  }
  p->cap = info->hw ? info->hw->device_bytes : 0;
  if (p->cap > ymax && p->cap < ymax * 1.5) ymax = p->cap;
  if (tmax <= 0) tmax = 1;
  if (ymax <= 0) ymax = 1;
  p->tms = tmax / 1e3;
  p->xs = nice_step(p->tms, 8);
  p->tms = ceil(p->tms / p->xs - 1e-9) * p->xs;
  p->ydiv = ymax * 1.05 >= GIB ? GIB : MIB;
  p->hdiv = hmax * 1.05 >= GIB || hmax <= 0 ? GIB : MIB;
  p->yg = ymax / p->ydiv * 1.05;
  p->ys = nice_step(p->yg, 6);
  p->yg = ceil(p->yg / p->ys - 1e-9) * p->ys;
  int ticks = (int)lround(p->yg / p->ys);
  p->hs = nice_ceil((hmax > 0 ? hmax / p->hdiv * 1.05 : 1) / ticks);
  p->hg = p->hs * ticks;
  /* below the plot: tick labels, the axis title, the stall strip's title
   * and its rows, then the legend */
  p->sT = p->B + 62;
  p->sB = p->sT + n * p->row + 6;
  p->legend_y = p->sB + 30;
  p->occ_w = (p->R - p->L) / OCC + 1;
  p->occ_h = (p->B - p->T) / OCC + 1;
  p->occ = calloc((size_t)p->occ_w * (size_t)p->occ_h, 1);
}

/* ---- the SVG's parts ------------------------------------------------------------------ */

/* The title, grid, ticks, both axes and their titles, the capacity line. */
static void svg_axes(svg *p, const sim_run_info *info) {
  FILE *f = p->f;
  const char *hw = info->hw ? info->hw->name : "?";
  const char *trace = info->trace_path ? info->trace_path : "trace";
  const char *base = strrchr(trace, '/');
  base = base && base[1] ? base + 1 : trace;
  char full[512], title[512];
  snprintf(full, sizeof full, "Memory over one training step: %s on %s", base, hw);
  fit_text(title, sizeof title, full, p->W - 40, 16);
  label(p, p->W / 2.0, 26, 16, MIDDLE, NULL, "title", title);
  label(p, p->W / 2.0, 46, 12, MIDDLE, "#444444", "subtitle",
        "the last replayed step of each run, time from its start; "
        "the baseline keeps everything on the device");
  /* vertical grid through the plot and the stall strip */
  for (double x = 0; x <= p->tms + 1e-9; x += p->xs) {
    double px = px_t(p, x);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#e4e4e4\"/>\n", px,
            p->T, px, p->B);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#eeeeee\"/>\n", px,
            p->sT, px, p->sB);
    char t[32];
    snprintf(t, sizeof t, "%g", x);
    label(p, px, p->B + 17, 11, MIDDLE, NULL, "tick x", t);
  }
  int ticks = (int)lround(p->yg / p->ys);
  for (int k = 0; k <= ticks; k++) {
    double y = k * p->ys, h = k * p->hs, py = py_dev(p, y * p->ydiv);
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", p->L, py,
            p->R, py);
    char t[32];
    snprintf(t, sizeof t, "%g", y);
    label(p, p->L - 7, py + 4, 11, END, NULL, "tick left", t);
    snprintf(t, sizeof t, "%g", h);
    label(p, p->R + 7, py + 4, 11, START, "#666666", "tick right", t);
  }
  /* the scales, for scripts: what the top edge and the right edge stand for */
  fprintf(f, "<rect class=\"plot-area\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
             "fill=\"none\" stroke=\"black\" data-device-bytes-top=\"%.0f\" "
             "data-host-bytes-top=\"%.0f\" data-ms-right=\"%g\"/>\n",
          p->L, p->T, p->R - p->L, p->B - p->T, p->yg * p->ydiv, p->hg * p->hdiv, p->tms);
  label(p, (p->L + p->R) / 2.0, p->B + 36, 12, MIDDLE, NULL, "axis-title x",
        "time since the step's start (ms)");
  /* the axis titles, turned along their axes */
  int mid = (p->T + p->B) / 2;
  fprintf(f, "<text class=\"axis-title left\" x=\"24\" y=\"%d\" text-anchor=\"middle\" "
             "transform=\"rotate(-90 24 %d)\">device memory in use (%s), solid lines</text>\n",
          mid, mid, p->ydiv == GIB ? "GiB" : "MiB");
  fprintf(f, "<text class=\"axis-title right\" x=\"%d\" y=\"%d\" text-anchor=\"middle\" "
             "fill=\"#666666\" transform=\"rotate(90 %d %d)\">pinned host memory in use (%s), "
             "dashed lines</text>\n", p->W - 30, mid, p->W - 30, mid,
          p->hdiv == GIB ? "GiB" : "MiB");
  /* the stall strip: a row per run */
  label(p, p->L, p->sT - 8, 12, START, NULL, "strip-title",
        "Exposed stalls: when each run's compute waited (the step is longer by them)");
  fprintf(f, "<rect class=\"stall-area\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
             "fill=\"none\" stroke=\"#999999\"/>\n", p->L, p->sT, p->R - p->L, p->sB - p->sT);
  if (p->cap > 0 && p->cap / p->ydiv <= p->yg) {
    double py = py_dev(p, p->cap);
    fprintf(f, "<line class=\"capacity\" x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
               "stroke=\"black\" stroke-dasharray=\"7 4\"/>\n", p->L, py, p->R, py);
    occupy(p, p->L, py, p->R, py);
    char t[128];
    snprintf(t, sizeof t, "%s capacity %.0f GB (%.1f GiB)", info->hw->name, p->cap / GB,
             p->cap / GIB);
    double ty = py - 5 - 0.25 * 11 > p->T + 11 ? py - 5 : py + 14;
    label(p, p->R - 5, ty, 11, END, NULL, "capacity-label", t);
  }
}

/* A step-shaped polyline of a series over [t_begin, t_end] of the step. */
static void svg_steps(svg *p, const sim_timeline *tl, const sim_mem_sample *s, size_t n,
                      int host) {
  double prev = -1, x = p->L, px = p->L;
  for (size_t k = 0; k < n; k++) {
    double ms = (s[k].t - tl->t_begin) / 1e3;
    if (ms < 0) ms = 0;
    x = px_t(p, ms);
    double y = host ? py_host(p, (double)s[k].bytes) : py_dev(p, (double)s[k].bytes);
    if (prev >= 0) {
      fprintf(p->f, "%.1f,%.1f ", x, prev);
      occupy(p, px, prev, x, prev);
      occupy(p, x, prev, x, y);
    }
    fprintf(p->f, "%.1f,%.1f ", x, y);
    prev = y;
    px = x;
  }
  double end = px_t(p, (tl->t_end - tl->t_begin) / 1e3);
  if (prev >= 0 && end > x) {
    fprintf(p->f, "%.1f,%.1f", end, prev);
    occupy(p, x, prev, end, prev);
  }
}

/* Run i's device curve (left axis), pinned host curve (right axis, when it
 * pins any) and backward's start. */
static void svg_curves(svg *p, const sim_result *r, int i) {
  FILE *f = p->f;
  const sim_timeline *tl = &r->tl;
  const char *c = run_color(i);
  fprintf(f, "<polyline class=\"device-curve\" data-run=\"");
  xml_text(f, r->label);
  fprintf(f, "\" fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" stroke-linejoin=\"round\" "
             "points=\"", c, i ? "1.8" : "2.6");
  svg_steps(p, tl, tl->mem, tl->n_mem, 0);
  fputs("\"/>\n", f);
  if (host_max(r) > 0) {
    fprintf(f, "<polyline class=\"host-curve\" data-run=\"");
    xml_text(f, r->label);
    fprintf(f, "\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" stroke-dasharray=\"6 3\" "
               "points=\"", c);
    svg_steps(p, tl, tl->host, tl->n_host, 1);
    fputs("\"/>\n", f);
  }
  if (tl->t_backward > tl->t_begin) {
    double px = px_t(p, (tl->t_backward - tl->t_begin) / 1e3);
    fprintf(f, "<line class=\"backward\" data-run=\"");
    xml_text(f, r->label);
    fprintf(f, "\" x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"%s\" stroke-width=\"1.2\" "
               "stroke-dasharray=\"2 3\"/>\n", px, p->T, px, p->B, c);
  }
}

static const char *const wait_names[3] = {"a reload", "copies (stash bound, step end)",
                                          "pinning host memory"};
static const char *const wait_classes[3] = {"reload", "copies", "pinning"};

/* One merged run of waits of a kind as a rect in row i of the strip. */
static void svg_wait_rect(svg *p, const sim_result *r, int i, int kind, double x0, double x1,
                          double us) {
  const char *c = run_color(i);
  double y = p->sT + 4 + i * p->row, h = p->row - 5;
  if (x1 - x0 < 1) x1 = x0 + 1; /* a short wait stays visible */
  if (x1 > p->R) x0 -= x1 - p->R, x1 = p->R;
  char d[32];
  fmt_us(d, sizeof d, us);
  fprintf(p->f, "<rect class=\"stall %s\" data-run=\"", wait_classes[kind]);
  xml_text(p->f, r->label);
  fprintf(p->f, "\" data-us=\"%.3f\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                "fill=\"%s\" fill-opacity=\"%s\"%s><title>",
          us, x0, y, x1 - x0, h, c, kind == 0 ? "0.95" : kind == 1 ? "0.4" : "0.12",
          kind == 2 ? " stroke=\"black\" stroke-width=\"0.8\"" : "");
  xml_text(p->f, r->label);
  fprintf(p->f, ": waits for %s, %s</title></rect>\n", wait_names[kind], d);
}

/* Run i's row of the stall strip: its waits (those closer than a pixel
 * merged), its name on the left and its total on the right. */
static void svg_waits(svg *p, const sim_result *r, int i) {
  const sim_timeline *tl = &r->tl;
  double lim = px_t(p, p->tms);
  int kind = -1;
  double x0 = 0, x1 = 0, us = 0, total = 0;
  for (size_t k = 0; k < tl->n_waits; k++) {
    const sim_wait *w = &tl->waits[k];
    double a = (w->t0 - tl->t_begin) / 1e3, b = (w->t1 - tl->t_begin) / 1e3;
    if (b <= 0 || w->kind < 0 || w->kind > 2) continue;
    if (a < 0) a = 0;
    double xa = px_t(p, a), xb = px_t(p, b);
    if (xb > lim) xb = lim;
    total += w->t1 - w->t0;
    if (kind == w->kind && xa <= x1 + 0.5) {
      if (xb > x1) x1 = xb;
      us += w->t1 - w->t0;
      continue;
    }
    if (kind >= 0) svg_wait_rect(p, r, i, kind, x0, x1, us);
    kind = w->kind;
    x0 = xa;
    x1 = xb;
    us = w->t1 - w->t0;
  }
  if (kind >= 0) svg_wait_rect(p, r, i, kind, x0, x1, us);
  double y = p->sT + 4 + i * p->row + p->row - 7;
  char name[64];
  fit_text(name, sizeof name, r->label, p->L - 14, 11);
  label(p, p->L - 7, y, 11, END, run_color(i), "strip-label", name);
  char t[32];
  fmt_us(t, sizeof t, total);
  label(p, p->R + 7, y, 11, START, run_color(i), "strip-total", total > 0 ? t : "none");
}

typedef struct spot {
  double x, y, cost;
  int anchor;
} spot;

static int by_cost(const void *a, const void *b) {
  double d = ((const spot *)a)->cost - ((const spot *)b)->cost;
  return d < 0 ? -1 : d > 0;
}

/* Whether segments a and b cross (end points as box corners). */
static int crosses(box a, box b) {
  double d1 = (b.x1 - b.x0) * (a.y0 - b.y0) - (b.y1 - b.y0) * (a.x0 - b.x0);
  double d2 = (b.x1 - b.x0) * (a.y1 - b.y0) - (b.y1 - b.y0) * (a.x1 - b.x0);
  double d3 = (a.x1 - a.x0) * (b.y0 - a.y0) - (a.y1 - a.y0) * (b.x0 - a.x0);
  double d4 = (a.x1 - a.x0) * (b.y1 - a.y0) - (a.y1 - a.y0) * (b.x1 - a.x0);
  return ((d1 > 0) != (d2 > 0)) && ((d3 > 0) != (d4 > 0));
}

#define LABEL_FS 11
/* More runs than this (a sweep): their peaks are marked, not labelled (the
 * legend's rows give the figures) */
#define MAX_LABELLED 8

/* The leader from a marker at (x, y) to text at (tx, ty), or a zero-length
 * one when the text is close enough to need none. */
static box leader(double x, double y, double tx, double ty, int anchor) {
  double ly = ty - 0.3 * LABEL_FS, gap = anchor == START ? tx - x : x - tx;
  if (fabs(ly - y) <= 14 && gap <= 24) return (box){x, y, x, y};
  return (box){x, y, anchor == START ? tx - 2 : tx + 2, ly};
}

static int is_point(box l) { return l.x0 == l.x1 && l.y0 == l.y1; }

/* Whether leader l crosses another leader or passes through a text box or
 * marker (its first 7 px, in its own marker, aside). */
static int leader_clashes(const svg *p, box l) {
  if (is_point(l)) return 0;
  for (int i = 0; i < p->n_leaders; i++)
    if (crosses(l, p->leaders[i])) return 1;
  double len = hypot(l.x1 - l.x0, l.y1 - l.y0);
  for (double d = 7; d < len - 2; d += 2) {
    double x = l.x0 + (l.x1 - l.x0) * d / len, y = l.y0 + (l.y1 - l.y0) * d / len;
    for (int i = 0; i < p->n_used; i++)
      if (x > p->used[i].x0 && x < p->used[i].x1 && y > p->used[i].y0 && y < p->used[i].y1)
        return 1;
  }
  return 0;
}

/* A peak to mark: its run, device or host, the marker, the text, where
 * the text may go (cheapest first) and where it went. */
typedef struct mark {
  int run, host;
  double x, y, bytes;
  char text[192];
  spot *spots;
  size_t n_spots;
  double bx, by;
  int anchor, found;
} mark;

/* The places for m's text inside the plot, its near end 8 px or more from
 * the marker, by distance (beside rather than far, above rather than below). */
static void mark_spots(const svg *p, mark *m) {
  box area = {p->L + 3, p->T + 3, p->R - 3, p->B - 3};
  int nx = (int)((area.x1 - area.x0) / 6) + 1, ny = (int)((area.y1 - area.y0) / 5) + 1;
  m->spots = malloc((size_t)nx * (size_t)ny * 2 * sizeof *m->spots);
  m->n_spots = 0;
  if (!m->spots) return;
  for (int j = 0; j < ny; j++)
    for (int i = 0; i < nx; i++)
      for (int side = 0; side < 2; side++) {
        double tx = area.x0 + i * 6.0, ty = area.y0 + j * 5.0 + 0.8 * LABEL_FS;
        box b = text_box(tx, ty, m->text, LABEL_FS, side ? END : START);
        if (b.x0 < area.x0 || b.x1 > area.x1 || b.y0 < area.y0 || b.y1 > area.y1) continue;
        double dx = side ? m->x - 8 - tx : tx - m->x - 8, dy = ty - 0.3 * LABEL_FS - m->y;
        if (dx < 0) continue;
        m->spots[m->n_spots++] =
            (spot){tx, ty, hypot(dx * 1.5, dy < 0 ? dy : dy * 1.3), side ? END : START};
      }
  qsort(m->spots, m->n_spots, sizeof *m->spots, by_cost);
}

/* Whether a marker other than m's is nearer than m's to text at c (its
 * near end's middle). */
static int nearer_mark(const svg *p, const mark *m, const spot *c) {
  double ny = c->y - 0.3 * LABEL_FS, own = hypot(c->x - m->x, ny - m->y);
  for (int i = 0; i < p->n_marks; i++) {
    double x = p->marks[i][0], y = p->marks[i][1];
    if ((x != m->x || y != m->y) && hypot(c->x - x, ny - y) < own + 2) return 1;
  }
  return 0;
}

/* Places m's text: clear of the other text and markers; clear of the
 * curves and the other leaders, too, unless that puts it much farther. The
 * cost: the distance, more with a leader, across a curve (the text has a
 * halo; more the more of it the curve covers) or a leader, most for no
 * place. Keeps its box and leader. */
static double place(svg *p, mark *m) {
  double least = 1e6;
  const spot *pick = NULL;
  for (size_t k = 0; k < m->n_spots && m->spots[k].cost < least; k++) {
    const spot *c = &m->spots[k];
    box b = text_box(c->x, c->y, m->text, LABEL_FS, c->anchor);
    if (!box_free(p, b)) continue;
    box l = leader(m->x, m->y, c->x, c->y, c->anchor);
    if (is_point(l) && nearer_mark(p, m, c)) continue; /* it would read as another's */
    double cost = c->cost + (is_point(l) ? 0 : 40);
    int on = cost < least ? box_on_line(p, b) : 0; /* a few cells: across a curve; many: along */
    cost += on ? 40 + 3.0 * (on < 30 ? on : 30) : 0;
    if (cost < least && leader_clashes(p, l)) cost += 200;
    if (cost < least) least = cost, pick = c;
  }
  m->found = pick != NULL;
  if (!pick) return least;
  m->bx = pick->x, m->by = pick->y, m->anchor = pick->anchor;
  keep_box(p, text_box(pick->x, pick->y, m->text, LABEL_FS, pick->anchor));
  box l = leader(m->x, m->y, pick->x, pick->y, pick->anchor);
  if (!is_point(l) && p->n_leaders < MAX_BOXES) p->leaders[p->n_leaders++] = l;
  return least;
}

/* A marker, its leader and its text, as placed. */
static void svg_mark(svg *p, const sim_result *r, const mark *m) {
  FILE *f = p->f;
  const char *c = run_color(m->run);
  fprintf(f, "<g class=\"peak %s\" data-run=\"", m->host ? "host" : "device");
  xml_text(f, r->label);
  fprintf(f, "\" data-bytes=\"%.0f\">\n", m->bytes);
  box l = leader(m->x, m->y, m->bx, m->by, m->anchor);
  if (m->found && !is_point(l))
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
               "stroke-width=\"0.8\"/>\n", l.x0, l.y0, l.x1, l.y1, c);
  if (m->host)
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"7\" height=\"7\" fill=\"white\" stroke=\"%s\" "
               "stroke-width=\"1.6\"/>\n", m->x - 3.5, m->y - 3.5, c);
  else
    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.8\" fill=\"%s\" stroke=\"white\" "
               "stroke-width=\"1.2\"/>\n", m->x, m->y, c);
  if (m->found) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"%d\"%s fill=\"%s\" stroke=\"white\" "
               "stroke-width=\"3\" stroke-linejoin=\"round\" paint-order=\"stroke\">",
            m->bx, m->by, LABEL_FS, m->anchor == END ? " text-anchor=\"end\"" : "", c);
    xml_text(f, m->text);
    fputs("</text>\n", f);
  }
  fputs("</g>\n", f);
}

/* Every run's peaks (device and pinned host), marked where the last step
 * reaches them and labelled with the run's figure. The labels are placed
 * one at a time, nearest free spot first; as the order matters, a few
 * orders are tried and the cheapest kept. */
static void svg_peaks(svg *p, const sim_result *rs, int n) {
  mark *m = calloc((size_t)n * 2, sizeof *m);
  int *order = calloc((size_t)n * 2, sizeof *order), *best = calloc((size_t)n * 2, sizeof *best);
  svg *saved = malloc(sizeof *saved);
  int k = 0;
  for (int i = 0; m && i < n; i++) {
    const sim_timeline *tl = &rs[i].tl;
    for (int host = 0; host < 2; host++) {
      double at = tl->t_begin;
      double v = host ? series_peak(tl->host, tl->n_host, &at) : series_peak(tl->mem, tl->n_mem, &at);
      if (v < 0 || (host && (v <= 0 || rs[i].peak_host_bytes == 0))) continue;
      double ms = (at - tl->t_begin) / 1e3;
      mark *x = &m[k++];
      x->run = i;
      x->host = host;
      x->x = px_t(p, ms < 0 ? 0 : ms);
      x->y = host ? py_host(p, v) : py_dev(p, v);
      x->bytes = host ? (double)rs[i].peak_host_bytes : (double)rs[i].peak_device_bytes;
      char b[32];
      fmt_bytes(b, sizeof b, x->bytes);
      char name[128];
      fit_text(name, sizeof name, rs[i].label, 200, LABEL_FS);
      snprintf(x->text, sizeof x->text, "%s %s %s", name, host ? "host peak" : "peak", b);
    }
  }
  if (!m || !order || !best || !saved) k = 0;
  for (int j = 0; j < k; j++) {
    keep_box(p, (box){m[j].x - 5, m[j].y - 5, m[j].x + 5, m[j].y + 5});
    if (p->n_marks < MAX_BOXES) {
      p->marks[p->n_marks][0] = m[j].x;
      p->marks[p->n_marks++][1] = m[j].y;
    }
  }
  /* more than MAX_LABELLED runs: markers only (the legend's rows give the figures) */
  for (int j = 0; j < k && n <= MAX_LABELLED; j++) mark_spots(p, &m[j]);
  if (k) *saved = *p;
  double least = INFINITY;
  unsigned seed = 12345;
  int trials = n > MAX_LABELLED ? 0 : k < 2 ? 1 : k <= 8 ? 24 : 6;
  for (int trial = 0; trial < trials; trial++) {
    for (int j = 0; j < k; j++) order[j] = j;
    if (trial == 0 || trial == 1) /* highest on the page first, then lowest */
      for (int a = 0; a < k; a++)
        for (int b = a + 1; b < k; b++)
          if ((m[order[b]].y < m[order[a]].y) == (trial == 0)) {
            int t = order[a];
            order[a] = order[b];
            order[b] = t;
          }
    if (trial >= 2) /* shuffled, the same every time */
      for (int a = k - 1; a > 0; a--) {
        seed = seed * 1103515245u + 12345u;
        int b = (int)((seed >> 16) % (unsigned)(a + 1)), t = order[a];
        order[a] = order[b];
        order[b] = t;
      }
    *p = *saved;
    double cost = 0;
    for (int j = 0; j < k; j++) cost += place(p, &m[order[j]]);
    if (cost < least) {
      least = cost;
      memcpy(best, order, (size_t)k * sizeof *best);
    }
  }
  if (k) {
    *p = *saved;
    for (int j = 0; j < k && n <= MAX_LABELLED; j++) place(p, &m[best[j]]);
    for (int j = 0; j < k; j++) svg_mark(p, &rs[m[j].run], &m[j]);
  }
  for (int j = 0; j < k; j++) free(m[j].spots);
  free(m);
  free(order);
  free(best);
  free(saved);
}

/* A legend key's symbol at (x, y) (the text's baseline); returns its width. */
static double key_symbol(FILE *f, int what, double x, double y) {
  double m = y - 4;
  switch (what) {
  case 0: /* device curve */
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\" "
               "stroke-width=\"2\"/>\n", x, m, x + 26, m);
    return 32;
  case 1: /* host curve */
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\" "
               "stroke-width=\"1.5\" stroke-dasharray=\"6 3\"/>\n", x, m, x + 26, m);
    return 32;
  case 2: /* backward */
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\" "
               "stroke-width=\"1.2\" stroke-dasharray=\"2 3\"/>\n", x + 6, y - 11, x + 6, y + 3);
    return 14;
  case 3: /* capacity */
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\" "
               "stroke-dasharray=\"7 4\"/>\n", x, m, x + 26, m);
    return 32;
  case 4: /* device peak */
    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.8\" fill=\"#333333\"/>\n", x + 5, m);
    return 13;
  case 5: /* host peak */
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"7\" height=\"7\" fill=\"white\" "
               "stroke=\"#333333\" stroke-width=\"1.6\"/>\n", x + 1.5, m - 3.5);
    return 13;
  default: { /* waits: 6 reload, 7 copies, 8 pinning */
    static const char *const op[3] = {"0.95", "0.4", "0.12"};
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"18\" height=\"11\" fill=\"#333333\" "
               "fill-opacity=\"%s\"%s/>\n", x, y - 10, op[what - 6],
            what == 8 ? " stroke=\"black\" stroke-width=\"0.8\"" : "");
    return 24;
  }
  }
}

/* Below everything: a row per run with its figures, then the keys, wrapped
 * to the plot's width. Returns the canvas height it needs. */
static int svg_legend(svg *p, const sim_run_info *info, const sim_result *rs, int n) {
  FILE *f = p->f;
  double y = p->legend_y;
  for (int i = 0; i < n; i++, y += 18) {
    const sim_result *r = &rs[i];
    char pk[32], hp[32], st[32], sl[32], t[400], rest[256], name[128];
    fmt_bytes(pk, sizeof pk, (double)r->peak_device_bytes);
    fmt_bytes(hp, sizeof hp, (double)r->peak_host_bytes);
    fmt_us(st, sizeof st, r->step_us);
    fmt_us(sl, sizeof sl, r->stall_us + r->host_wait_us);
    snprintf(rest, sizeof rest, ": device peak %s, pinned host peak %s, step %s, stall %s", pk,
             hp, st, sl);
    fit_text(name, sizeof name, r->label, p->W - 8 - (p->L + 32) - text_w(rest, 12), 12);
    snprintf(t, sizeof t, "%s%s", name, rest);
    fprintf(f, "<g class=\"legend run\" data-run=\"");
    xml_text(f, r->label);
    fprintf(f, "\">\n<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
               "stroke-width=\"3\"/>\n", p->L, y - 4, p->L + 26, y - 4, run_color(i));
    label(p, p->L + 32, y, 12, START, NULL, "legend-text", t);
    fputs("</g>\n", f);
  }
  char cap[160];
  if (p->cap > 0 && p->cap / p->ydiv <= p->yg)
    snprintf(cap, sizeof cap, "%s capacity", info->hw->name);
  else if (p->cap > 0)
    snprintf(cap, sizeof cap, "%s capacity %.0f GB: above the scale", info->hw->name,
             p->cap / GB);
  else
    snprintf(cap, sizeof cap, "capacity unknown");
  const char *keys[9] = {"device memory (left axis)", "pinned host memory (right axis)",
                         "backward starts (forward is left of it)", cap,
                         n > MAX_LABELLED ? "device peak (figures above)" : "device peak",
                         n > MAX_LABELLED ? "host peak (figures above)" : "host peak", "waits for a reload", "host waits for copies",
                         "host pins memory"};
  double x = p->L;
  y += 8;
  fputs("<g class=\"legend keys\">\n", f);
  for (int k = 0; k < 9; k++) {
    double w = (k < 2 || k == 3 ? 32 : k == 2 ? 14 : k < 6 ? 13 : 24) + text_w(keys[k], 12);
    if (x > p->L && x + w > p->R) {
      x = p->L;
      y += 20;
    }
    double sw = key_symbol(f, k, x, y);
    label(p, x + sw, y, 12, START, NULL, "legend-text", keys[k]);
    x += w + 22;
  }
  fputs("</g>\n", f);
  return (int)ceil(y + 16);
}

/* The whole SVG to f; inline (in HTML) without the namespace declaration. */
void svg_write(FILE *f, const sim_run_info *info, const sim_result *rs, int n,
                      int inline_svg) {
  svg *p = calloc(1, sizeof *p);
  if (!p) return;
  p->f = f;
  svg_layout(p, info, rs, n);
  /* the height is known once the legend is laid out: write the body to a
   * buffer first */
  char *body = NULL;
  size_t len = 0;
  FILE *b = open_memstream(&body, &len);
  if (!b) {
    free(p->occ);
    free(p);
    return;
  }
  p->f = b;
  svg_axes(p, info);
  for (int i = 0; i < n; i++) svg_curves(p, &rs[i], i);
  for (int i = 0; i < n; i++) svg_waits(p, &rs[i], i);
  svg_peaks(p, rs, n);
  p->H = svg_legend(p, info, rs, n);
  fclose(b);
  fprintf(f, "<svg%s width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" "
             "font-size=\"12\"%s>\n",
          inline_svg ? "" : " xmlns=\"http://www.w3.org/2000/svg\"", p->W, p->H, p->W, p->H,
          inline_svg ? " style=\"max-width:100%;height:auto\"" : "");
  fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", p->W, p->H);
  fwrite(body, 1, len, f);
  fputs("</svg>\n", f);
  free(body);
  free(p->occ);
  free(p);
}

int sim_write_svg(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                  char *err, size_t errlen) {
  FILE *f = fopen(path, "w");
  if (!f) {
    snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
    return -1;
  }
  svg_write(f, info, rs, n, 0);
  return close_checked(f, path, err, errlen);
}
