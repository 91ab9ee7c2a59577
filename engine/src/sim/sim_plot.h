/*
 * sim_plot.h — what the HTML report (sim_html.c) takes from the SVG writer
 * (sim_plot.c).
 */
#ifndef FERRY_SIM_PLOT_H
#define FERRY_SIM_PLOT_H

#include <stdio.h>

#include "ferry_tools.h"

const char *run_color(int i);
void xml_text(FILE *f, const char *str);
void svg_write(FILE *f, const sim_run_info *info, const sim_result *rs, int n, int inline_svg);

#endif
